"""One trainer rank's megatron shards -> the pieces of HF tensors they cover, and pieces -> full
HF tensors again: the pure half of a sharded weight push (issue 47), where every rank sends only
what it owns, converted locally, and no rank gathers the whole model.

`ArchMapping.megatron_to_hf` converts the TP shards of a parameter after they were gathered;
`shard_to_hf_slices` converts ONE rank's shard without them. Every TP kind of the tables
(`megarl.formats.tables`) lands as contiguous blocks of the HF tensors along one dim:
- column: rows [r*n, (r+1)*n) of the HF tensor (n = the shard's rows).
- row (o_proj, down_proj): columns [r*n, (r+1)*n), dim 1.
- vocab (embedding, output layer): rows [r*n, (r+1)*n) cut at the true vocab: megatron's
  padding rows are dropped, so a last rank may contribute a shorter piece, or none.
- qkv (fused weight and bias): TP rank r holds whole GQA groups r*G/tp .. (r+1)*G/tp - 1, that
  is heads r*nq/tp .. of q, r*nkv/tp .. of k and of v: one contiguous block of each of
  q_proj / k_proj / v_proj (three pieces).
- gate_up (fc1 = [gate_r; up_r] per rank): block r of gate_proj and block r of up_proj.
- replicated (norms, router, q/k norm, shared-expert gate): the whole tensor, from the rank the
  caller names with `sends_replicated` (TP rank 0), so each byte is sent once.
Experts use the same rules with the expert TP rank and size (`ArchMapping.hf_to_megatron`
splits an expert's MLP over TP like a dense one); a local expert e is HF expert
expert_offset + e, a stage-local layer i is HF layer layer_offset + i, as in `megatron_to_hf`.
The tied duplicate `output_layer.weight` of the last PP stage yields nothing (the first stage's
embedding is the source), as `megatron_to_hf` ignores it.

`assemble` (a dict of full tensors) and `place` + `Coverage` (into preallocated staging memory,
as a receiver does) rebuild the HF tensors and raise, naming the tensor, when pieces overlap,
disagree on the full shape, or leave part of a tensor uncovered.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
from torch import Tensor

from megarl.formats import ops
from megarl.formats.mapping import ArchMapping
from megarl.formats.tables import _TIED_OUTPUT, is_extra_state


@dataclass(frozen=True, eq=False)
class HFSlice:
    """A contiguous block of one HF tensor: `tensor` is `full.narrow(dim, start, length)` of the
    full tensor `name` of shape `shape`. A whole tensor is dim 0, start 0. `tensor` may be a
    view of the shard it came from (no copy where the block already was contiguous)."""
    name: str
    shape: tuple[int, ...]
    dim: int
    start: int
    tensor: Tensor

    @property
    def length(self) -> int:
        """The piece's extent along `dim`."""
        return self.tensor.shape[self.dim]

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.length == self.shape[self.dim]

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def _piece(mapping: ArchMapping, name: str, dim: int, start: int, t: Tensor) -> HFSlice:
    shape = mapping.dims.hf_shape(name)
    if start == 0 and t.shape[dim] == shape[dim]:
        dim = 0   # a whole tensor is dim 0 whatever its kind, so pieces of one tensor agree on it
    return HFSlice(name, shape, dim, start, t.contiguous())


def shard_to_hf_slices(mapping: ArchMapping, mcore_name: str, shard: Tensor, *, tp_rank: int,
                       tp_size: int, layer_offset: int = 0, expert_offset: int = 0,
                       sends_replicated: bool = True) -> list[HFSlice]:
    """The HF pieces ONE rank's shard of megatron parameter `mcore_name` covers (module docstring).

    tp_rank / tp_size: this rank's place in the parameter's TP group (the expert TP group for an
    expert's tensors). layer_offset: the PP stage's first global layer; expert_offset: the EP
    rank's first global expert. sends_replicated: whether this rank contributes the parameters
    every TP rank holds whole (pass tp_rank == 0). Returns [] for a replicated parameter on
    other ranks, for the tied duplicate output layer, and for a vocab shard of padding only.
    Raises naming the parameter when the shard's shape does not fit the model at tp_size.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"megatron parameter {mcore_name!r}: tp_rank={tp_rank} outside 0..{tp_size - 1}")
    m, local, expert = mapping.locate(mcore_name)
    if m is _TIED_OUTPUT:
        return []
    # the shape check of the gathered path, as if every TP rank held a shard like this one
    mapping._check_shards(mcore_name, m, [shard] * tp_size)
    layer = None if local is None else local + layer_offset
    e = None if expert is None else expert + expert_offset
    names = [h.format(i=layer, e=e) for h in m.hf]
    if m.kind == "replicated":
        return [_piece(mapping, names[0], 0, 0, shard)] if sends_replicated else []
    if m.kind in ("column", "row"):
        dim = m.partition_dim
        n = shard.shape[dim]
        return [_piece(mapping, names[0], dim, tp_rank * n, shard)]
    if m.kind == "vocab":
        return _vocab_piece(mapping, mcore_name, names[0], shard, tp_rank, tp_size)
    if m.kind == "qkv":
        d = mapping.dims
        q_heads, kv_heads = d.num_heads // tp_size, d.num_kv_heads // tp_size
        # a rank's shard is itself a fused QKV of its own whole GQA groups (ops.qkv_shards)
        q, k, v = ops.qkv_from_megatron(shard, q_heads, kv_heads, d.head_dim)
        kv_start = tp_rank * kv_heads * d.head_dim
        return [_piece(mapping, names[0], 0, tp_rank * q_heads * d.head_dim, q),
                _piece(mapping, names[1], 0, kv_start, k), _piece(mapping, names[2], 0, kv_start, v)]
    # gate_up: rank r's fc1 is [gate block r; up block r] (ops.fc1_shards_from_gate_up)
    gate, up = torch.chunk(shard, 2, dim=0)
    n = gate.shape[0]
    return [_piece(mapping, names[0], 0, tp_rank * n, gate), _piece(mapping, names[1], 0, tp_rank * n, up)]


def _vocab_piece(mapping: ArchMapping, mcore_name: str, hf_name: str, shard: Tensor, tp_rank: int,
                 tp_size: int) -> list[HFSlice]:
    """Rows [r*n, (r+1)*n) of the padded vocab, cut at the true vocab (none: padding only)."""
    vocab, rows = mapping.dims.vocab, shard.shape[0]
    if rows * tp_size < vocab:
        raise ValueError(f"megatron parameter {mcore_name!r}: {tp_size} TP shards of {rows} rows hold "
                         f"fewer rows than vocab_size={vocab}")
    start = tp_rank * rows
    keep = min(rows, vocab - start)
    if keep <= 0:
        return []
    return [_piece(mapping, hf_name, 0, start, shard[:keep])]


def rank_to_hf_slices(mapping: ArchMapping, state_dict: Mapping[str, Tensor], *, tp_rank: int,
                      tp_size: int, layer_offset: int = 0, expert_offset: int = 0,
                      sends_replicated: bool = True, experts_only: bool = False) -> list[HFSlice]:
    """`shard_to_hf_slices` of every parameter of one rank's megatron state dict (`_extra_state`
    keys skipped). experts_only=True keeps only the experts' pieces: megatron carves expert
    parallelism out of data parallelism, so an EP rank outside DP replica 0 holds copies of the
    dense parameters that replica 0 already sends."""
    out: list[HFSlice] = []
    for name, shard in state_dict.items():
        if is_extra_state(name) or (experts_only and mapping.locate(name)[2] is None):
            continue
        out += shard_to_hf_slices(mapping, name, shard, tp_rank=tp_rank, tp_size=tp_size,
                                  layer_offset=layer_offset, expert_offset=expert_offset,
                                  sends_replicated=sends_replicated)
    return out


def place(piece: HFSlice, full: Tensor) -> None:
    """Copy `piece` into its block of the preallocated full tensor `full` (shape and dtype must be
    the piece's; no coverage is tracked: see `Coverage`)."""
    if tuple(full.shape) != tuple(piece.shape) or full.dtype != piece.tensor.dtype:
        raise ValueError(f"HF tensor {piece.name!r}: piece of {tuple(piece.shape)} {piece.tensor.dtype} "
                         f"placed into a tensor of {tuple(full.shape)} {full.dtype}")
    full.narrow(piece.dim, piece.start, piece.length).copy_(piece.tensor)


class Coverage:
    """Which blocks of each HF tensor pieces have covered. `add` raises on an overlapping or
    inconsistent piece before it is placed; `check_complete` raises on an uncovered block."""

    def __init__(self) -> None:
        self._shape: dict[str, tuple[int, ...]] = {}
        self._dim: dict[str, int] = {}
        self._spans: dict[str, list[tuple[int, int]]] = {}

    def add(self, piece: HFSlice) -> None:
        name, shape, dim = piece.name, tuple(piece.shape), piece.dim
        if not 0 <= dim < len(shape):
            raise ValueError(f"HF tensor {name!r}: piece along dim {dim} of a {len(shape)}-dim tensor")
        want = shape[:dim] + (piece.length,) + shape[dim + 1:]
        if tuple(piece.tensor.shape) != want or piece.start < 0 or piece.start + piece.length > shape[dim]:
            raise ValueError(f"HF tensor {name!r}: piece of shape {tuple(piece.tensor.shape)} at "
                             f"{piece.start} along dim {dim} does not fit the full shape {shape}")
        if name not in self._shape:
            self._shape[name], self._dim[name], self._spans[name] = shape, dim, []
        elif self._shape[name] != shape:
            raise ValueError(f"HF tensor {name!r}: pieces disagree on its shape: {self._shape[name]} "
                             f"and {shape}")
        elif self._dim[name] != dim:   # a whole piece (dim 0) beside a block along another dim
            raise ValueError(f"HF tensor {name!r}: overlapping pieces along dims {self._dim[name]} and "
                             f"{dim} (a whole tensor and a block of it)")
        lo, hi = piece.start, piece.start + piece.length
        for a, b in self._spans[name]:
            if lo < b and a < hi:
                raise ValueError(f"HF tensor {name!r}: overlapping pieces [{a}, {b}) and [{lo}, {hi}) "
                                 f"along dim {dim}")
        self._spans[name].append((lo, hi))

    def names(self) -> set[str]:
        return set(self._shape)

    def gaps(self, name: str) -> list[tuple[int, int]]:
        """The uncovered blocks [a, b) of `name` along its dim."""
        gaps, at = [], 0
        for a, b in sorted(self._spans[name]):
            if a > at:
                gaps.append((at, a))
            at = max(at, b)
        end = self._shape[name][self._dim[name]]
        return gaps + ([(at, end)] if at < end else [])

    def check_complete(self, expected: Iterable[str] | None = None) -> None:
        """Raise naming each HF tensor with an uncovered block, and each `expected` name no piece
        covered at all."""
        missing = sorted(set(expected or ()) - self.names())
        partial = {n: self.gaps(n) for n in sorted(self._shape)}
        partial = {n: g for n, g in partial.items() if g}
        if missing or partial:
            parts = [f"{n!r} misses {g} along dim {self._dim[n]}" for n, g in list(partial.items())[:8]]
            if missing:
                parts.append(f"no piece of {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                             f"({len(missing)} tensors)")
            raise ValueError("incomplete HF tensors: " + "; ".join(parts))


def assemble(pieces: Iterable[HFSlice], expected: Iterable[str] | None = None) -> dict[str, Tensor]:
    """The full HF tensors from their pieces (each allocated with its first piece's dtype and
    device). Raises naming the tensor when pieces overlap or disagree, when a tensor is not
    covered completely, or when a name of `expected` (e.g. `mapping.hf_names()`) has no piece."""
    coverage, out = Coverage(), {}
    for piece in pieces:
        coverage.add(piece)
        if piece.name not in out:
            out[piece.name] = torch.empty(piece.shape, dtype=piece.tensor.dtype, device=piece.tensor.device)
        place(piece, out[piece.name])
    coverage.check_complete(expected)
    return out
