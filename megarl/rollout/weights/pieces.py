"""Buckets of HF tensor pieces (a sharded push, weight_sync.sharded), and their assembly into
full HF tensors on the engine side.

In a sharded push every trainer rank sends the pieces of HF tensors its own shards cover
(`formats/shard_slices.py`: a TP rank's block of q_proj, its columns of o_proj, its experts).
A piece bucket is a packed bucket (`packing.BucketMeta`, one piece per entry) plus where each
piece lies in its full tensor: the full shape, the dimension and the start. The receiver places
every piece into a full tensor of its staging area as it arrives (`Assembler`, several senders'
threads at once) and, at the swap, hands vLLM's loader whole HF tensors, as the unsharded
route does, so the engine's weights end bitwise the same.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from megarl.formats.shard_slices import Coverage, HFSlice, place
from megarl.rollout.weights import packing


@dataclass(frozen=True)
class PieceMeta:
    """A packed bucket of pieces: `bucket` lays out the pieces' own tensors; `full_shapes`,
    `dims`, `starts` say where each lies in the full HF tensor of its name."""
    bucket: packing.BucketMeta
    full_shapes: list[list[int]]
    dims: list[int]
    starts: list[int]

    def __post_init__(self):
        n = len(self.bucket.names)
        if not (len(self.full_shapes) == len(self.dims) == len(self.starts) == n):
            raise ValueError(f"piece bucket metadata: {n} pieces but {len(self.full_shapes)} shapes, "
                             f"{len(self.dims)} dims, {len(self.starts)} starts")

    @property
    def nbytes(self) -> int:
        return self.bucket.nbytes

    def to_dict(self) -> dict:
        return {"bucket": self.bucket.to_dict(), "full_shapes": self.full_shapes, "dims": self.dims,
                "starts": self.starts}

    @classmethod
    def from_dict(cls, d: dict) -> "PieceMeta":
        b = d["bucket"]
        bucket = packing.BucketMeta(list(b["names"]), list(b["dtype_names"]), [list(s) for s in b["shapes"]],
                                    list(b["offsets"]), int(b["nbytes"]))
        return cls(bucket, [list(s) for s in d["full_shapes"]], [int(x) for x in d["dims"]],
                   [int(x) for x in d["starts"]])


def group_pieces(pieces: Iterable[HFSlice], bucket_bytes: int) -> Iterator[list[HFSlice]]:
    """Pieces in groups of about `bucket_bytes` (a larger piece is alone), in order."""
    group, size = [], 0
    for p in pieces:
        if group and size + p.nbytes > bucket_bytes:
            yield group
            group, size = [], 0
        group.append(p)
        size += p.nbytes
    if group:
        yield group


def layout(pieces: list[HFSlice]) -> PieceMeta:
    return PieceMeta(packing.layout([(p.name, p.tensor) for p in pieces]),
                     [list(p.shape) for p in pieces], [p.dim for p in pieces], [p.start for p in pieces])


def unpack(meta: PieceMeta, buf: torch.Tensor) -> list[HFSlice]:
    """Views into `buf`, as packing.unpack."""
    return [HFSlice(name, tuple(shape), dim, start, t)
            for (name, t), shape, dim, start in zip(packing.unpack(meta.bucket, buf), meta.full_shapes,
                                                     meta.dims, meta.starts)]


class Assembler:
    """Full HF tensors of one staged version, filled piece by piece by the receiver threads of
    every sender (thread-safe). Coverage is checked as pieces arrive (an overlap raises at
    once) and at the end (`tensors`: a gap names the tensor). The full tensors are reused by the
    next version where vLLM holds no view of them (packing.unshared)."""

    def __init__(self, kept: dict[str, torch.Tensor] | None = None):
        self._lock = threading.Lock()
        self._coverage = Coverage()
        self._kept = kept if kept is not None else {}
        self._full: dict[str, torch.Tensor] = {}

    def add(self, pieces: Iterable[HFSlice]) -> None:
        for p in pieces:
            with self._lock:
                self._coverage.add(p)
                full = self._full.get(p.name)
                if full is None:
                    full = self._reuse(p)
                    if full is None:
                        full = torch.empty(p.shape, dtype=p.tensor.dtype)
                    self._full[p.name] = full
            place(p, full)               # pieces never overlap (checked above): no lock needed

    def _reuse(self, p: HFSlice) -> torch.Tensor | None:
        old = self._kept.get(p.name)
        if old is not None and tuple(old.shape) == tuple(p.shape) and old.dtype == p.tensor.dtype \
                and packing.unshared(old):
            return old
        return None

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every full tensor, once each is covered completely (else ValueError naming the gaps);
        they are kept for the next version's reuse."""
        self._coverage.check_complete()
        self._kept.clear()
        self._kept.update(self._full)
        return dict(self._full)
