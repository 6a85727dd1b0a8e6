"""Routing replay's layout maths (docs/moe.md "Routing replay"): pure functions, no megatron.

The engine reports, per sample, the experts each MoE layer chose for each input token
(`Sample.routes`: [prompt + response - 1, MoE layers, top-k], row i for token i). The trainer
pads them into the batch's sequence layout ([B, L, MoE layers, top-k], `batch_routes`) and, per
micro-batch and MoE layer, hands megatron's router the [tokens, top-k] int64 indices in the
order its router sees tokens: sequence-major (token = s * b + row, hidden states are [s, b, h]),
only the positions this tensor-parallel rank holds under sequence parallelism
(`sequence_major`), only the MoE layers of this pipeline stage (`stage_columns`).

Positions without an engine route get the experts 0..k-1: valid, distinct ids, so the router
and dispatcher work as for any token. They are padding, each row's last token (never fed back
to the engine), and every position from a sample's `Sample.routes_needed` on where its routes
stop short: an episode's observation tokens not yet fed to an engine (carried between turns, or
its next turn held before its prefill), a refused sample's whole prompt (it has no response).
Their outputs reach no logprob of a trained token (causal attention: the route of position i
reaches the outputs of positions i and after, and response token j is predicted from position
prompt + j - 1), so which experts they get does not matter. A sample whose routes stop before
that is refused (None: an engine that did not capture them). `route_lengths` counts each row's
engine routes: routing agreement scores those positions only (`scored_positions`).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def route_dtype(max_id: int) -> torch.dtype:
    """The narrowest dtype holding expert ids up to `max_id` (uint8 below 256, as the engine's)."""
    return torch.uint8 if max_id < 256 else torch.int16 if max_id < 32768 else torch.int32


def filler(shape: tuple, topk: int, dtype: torch.dtype) -> torch.Tensor:
    """A routes tensor of `shape` (last axis top-k) holding experts 0..k-1 everywhere."""
    return torch.arange(topk, dtype=dtype).expand(*shape[:-1], topk).clone()


def batch_routes(samples: Sequence, length: int) -> torch.Tensor | None:
    """[B, length, MoE layers, top-k] of the samples' routes (row i of sample b at [b, i]),
    experts 0..k-1 past each sample's rows (module docstring); None when a sample's rows do not
    reach its `routes_needed` or no sample has any (algo.routing_replay=r3 refuses such a
    batch: replay_step)."""
    routes = [getattr(s, "routes", None) for s in samples]
    have = [r for r in routes if r is not None]
    if not have or any(_rows(r) < s.routes_needed for s, r in zip(samples, routes)):
        return None
    shapes = {tuple(np.shape(r)[1:]) for r in have}
    if len(shapes) != 1:
        raise ValueError(f"Sample.routes of one batch have different [MoE layers, top-k] shapes {sorted(shapes)}: "
                         f"every sample must come from the same model")
    for i, (s, r) in enumerate(zip(samples, routes)):
        want = len(s.prompt_ids) + len(s.response_ids) - 1
        if _rows(r) > want:
            raise ValueError(f"sample {i}: Sample.routes has {_rows(r)} rows for {want} input tokens "
                             f"(prompt + response - 1)")
    (layers, topk), = shapes
    top = max((int(np.max(r)) for r in have if np.size(r)), default=0)
    dtype = route_dtype(max(top, topk - 1))
    out = filler((len(samples), length, layers, topk), topk, dtype)
    for b, r in enumerate(routes):
        if r is not None:
            out[b, :len(r)] = torch.from_numpy(np.asarray(r).astype(np.int64)).to(dtype)
    return out


def route_lengths(samples: Sequence) -> torch.Tensor:
    """[B] long: each sample's rows of engine routes (0 without), the positions replayed from
    the engine; the rest of its row is filler."""
    return torch.tensor([_rows(getattr(s, "routes", None)) for s in samples], dtype=torch.long)


def _rows(routes) -> int:
    return 0 if routes is None else int(np.shape(routes)[0])


def stage_columns(moe_layer_freq: Sequence[int], held_layers: Sequence[int]) -> list[int]:
    """The MoE-layer axis positions (columns of Sample.routes) of the MoE layers among
    `held_layers` (global 0-based layer indices of one pipeline stage), in layer order; a dense
    layer (mlp_only_layers, decoder_sparse_step) has no router and no column."""
    before = np.cumsum([0, *moe_layer_freq])   # MoE layers before each layer
    return [int(before[i]) for i in sorted(held_layers) if moe_layer_freq[i]]


def sequence_major(routes: torch.Tensor, columns: Sequence[int], tp_rank: int = 0,
                   tp: int = 1) -> list[torch.Tensor]:
    """One micro-batch's routes [b, s, n, k] as the router's per-layer top-k indices: for each
    of `columns` (positions on the n axis), int64 [s' * b, k] in sequence-major order, s' = s / tp
    positions starting at tp_rank * s' (sequence parallelism splits the sequence over the TP
    ranks before the router; tp=1 without it)."""
    b, s = routes.shape[:2]
    if s % tp:
        raise ValueError(f"a micro-batch of {s} positions does not split over {tp} sequence-parallel ranks")
    part = s // tp
    local = routes[:, tp_rank * part:(tp_rank + 1) * part]
    return [local[:, :, c].transpose(0, 1).reshape(part * b, -1).long() for c in columns]


def batch_major(indices: torch.Tensor, rows: int) -> torch.Tensor:
    """The router's [s * b, k] indices back as [b, s, k] (sequence_major's inverse for one layer)."""
    return indices.reshape(-1, rows, indices.shape[-1]).transpose(0, 1)


def scored_positions(route_lens: torch.Tensor, trained: torch.Tensor, length: int, tp_rank: int = 0,
                     tp: int = 1) -> torch.Tensor:
    """bool [s' * b] in sequence_major's order: the positions with an engine route (s <
    route_lens: not padding, a row's last token or filler past a sample's routes) of rows that
    train (`trained` [b]: filler rows are copies and do not)."""
    part = length // tp
    pos = torch.arange(tp_rank * part, (tp_rank + 1) * part, device=route_lens.device)
    keep = (pos[:, None] < route_lens[None, :]) & trained[None, :].bool()
    return keep.reshape(-1)


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bool [T]: token t chose the same set of experts in `a` and `b` ([T, k] each, any order)."""
    return (a.sort(dim=-1).values == b.to(a.dtype).sort(dim=-1).values).all(dim=-1)
