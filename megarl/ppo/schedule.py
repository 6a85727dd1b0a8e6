"""Run a model over a batch in micro-batches with megatron's pipeline schedules.

The same call serves forward-only passes (old/reference logprobs, values) and training
passes, at any TP x PP: megatron's `get_forward_backward_func` picks the no-pipelining or
1F1B schedule, moves activations between stages and accumulates gradients.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from megarl.distributed import parallel
from megarl.models.masks import causal_mask
from megarl.ppo.batch import Batch


def run_microbatches(model, batch: Batch, micro_batch_size: int, loss_fn: Callable,
                     forward_only: bool, extras: dict | None = None) -> list[dict]:
    """Forward (and backward unless forward_only) over `batch` in micro-batches.

    loss_fn(mb: dict, output [b, L, ...]) -> (loss 0-d tensor, report dict); `mb` holds the
    micro-batch's Batch under "batch" and its rows of each tensor in `extras`.
    Returns the report dicts of this rank's micro-batches (empty off the last PP stage).
    megatron divides each micro-batch loss by the number of micro-batches; loss_fn's losses
    are already normalised by the global batch, so callers scale by `loss_scale`.
    """
    extras = extras or {}
    n = batch.size
    if n % micro_batch_size:
        raise ValueError(f"train.micro_batch_size={micro_batch_size} must divide the {n} rows on this rank")
    length = batch.tokens.shape[1]
    mask = causal_mask(length, batch.device)
    positions = torch.arange(length, device=batch.device).unsqueeze(0)
    micro = []
    for start in range(0, n, micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        micro.append({"batch": batch.select(rows), **{k: v[rows] for k, v in extras.items()}})

    def forward_step(data_iterator, model_chunk):
        mb = next(data_iterator)
        tokens = mb["batch"].tokens
        output = model_chunk(tokens, positions.expand_as(tokens), mask)
        return output, partial(loss_fn, mb)

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro), model=[model],
        num_microbatches=len(micro), seq_length=length, micro_batch_size=micro_batch_size,
        forward_only=forward_only)


def sum_reports(reports: list[dict]) -> dict:
    """Per-key sums of micro-batch reports, left on the device: the step reduces them over
    ranks and copies them to the host once (ppo/step.py)."""
    return {k: sum(r[k].detach() for r in reports) for k in reports[0]} if reports else {}


def loss_scale(num_microbatches: int) -> float:
    """Undo megatron's mean over micro-batches and DP ranks: our losses are global sums."""
    return float(num_microbatches * parallel.dp_size())


def share_from_last_stage(t: torch.Tensor | None, shape, device: torch.device,
                          dtype=torch.float) -> torch.Tensor:
    """Every PP stage gets the last stage's result (forward-only outputs live there)."""
    if parallel.pp_size() == 1:
        return t
    if not parallel.is_last_stage():
        t = torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(t, src=parallel.last_stage_global_rank(), group=parallel.pp_group())
    return t


def gather_dp(t: torch.Tensor) -> torch.Tensor:
    """Concatenate each DP rank's rows (dim 0) in DP-rank order."""
    if parallel.dp_size() == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(parallel.dp_size())]
    dist.all_gather(parts, t.contiguous(), group=parallel.dp_group())
    return torch.cat(parts, dim=0)


def forward_per_token(model, batch: Batch, micro_batch_size: int, fn: Callable) -> torch.Tensor:
    """Forward-only pass returning fn(mb, output) -> [b, R] for this rank's rows, on every PP
    stage. No gradients are kept."""

    def loss_fn(mb, output):
        with torch.no_grad():
            value = fn(mb, output)
        return torch.zeros((), device=value.device), {"value": value}

    with torch.no_grad():
        reports = run_microbatches(model, batch, micro_batch_size, loss_fn, forward_only=True)
    local = torch.cat([r["value"] for r in reports]) if reports else None
    return share_from_last_stage(local, tuple(batch.resp_mask.shape), batch.device)
