"""Packing a bucket of named tensors into one flat byte buffer, and back (pure functions), and
the pool of packed buffers reused push after push (`BufferPool`).

On the gloo wire, one broadcast per bucket instead of one per tensor (per-tensor messages are
the field's most reported cause of slow weight syncs; vLLM's nccl receiver takes one per
tensor, wires.py). The layout is fully described by `BucketMeta`, which is
what the trainer sends ahead of the bytes (`update_weights`' update_info): the receiver sizes
its buffer from it and never trusts anything else.
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

import torch

ALIGN = 64   # bytes: every tensor starts on a boundary any dtype's view accepts


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class BucketMeta:
    """Names, dtypes, shapes and byte offsets of the tensors packed in one buffer."""
    names: list[str]
    dtype_names: list[str]             # torch dtype names without "torch.", e.g. "float32"
    shapes: list[list[int]]
    offsets: list[int]                 # byte offset of each tensor in the buffer
    nbytes: int                        # buffer size in bytes (with alignment padding)

    def __post_init__(self):
        n = len(self.names)
        if not (len(self.dtype_names) == len(self.shapes) == len(self.offsets) == n):
            raise ValueError(f"bucket metadata: {n} names but {len(self.dtype_names)} dtypes, "
                             f"{len(self.shapes)} shapes, {len(self.offsets)} offsets")
        for name, dt, shape, off in zip(self.names, self.dtype_names, self.shapes, self.offsets):
            end = off + _numel(shape) * _dtype(dt).itemsize
            if off % ALIGN or off < 0 or end > self.nbytes:
                raise ValueError(f"bucket metadata: tensor {name!r} at bytes [{off}, {end}) does not "
                                 f"fit an aligned slot of a {self.nbytes}-byte buffer")

    def to_dict(self) -> dict:
        return asdict(self)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"bucket metadata: unknown dtype {name!r}")
    return dt


def layout(named: list[tuple[str, torch.Tensor]]) -> BucketMeta:
    """The packed layout of `named` (name, tensor) pairs, in order."""
    names, dtypes, shapes, offsets, off = [], [], [], [], 0
    for name, t in named:
        names.append(name)
        dtypes.append(str(t.dtype).removeprefix("torch."))
        shapes.append(list(t.shape))
        offsets.append(off)
        off = _aligned(off + t.numel() * t.element_size())
    return BucketMeta(names, dtypes, shapes, offsets, off)


def pack(named: list[tuple[str, torch.Tensor]], out: torch.Tensor | None = None) -> tuple[BucketMeta, torch.Tensor]:
    """Copy the tensors into one uint8 buffer [meta.nbytes] on their device (or into `out`, a
    reusable buffer at least that large: the double buffers of a sender)."""
    meta = layout(named)
    device = named[0][1].device if named else torch.device("cpu")
    if out is None or out.numel() < meta.nbytes:
        out = torch.empty(meta.nbytes, dtype=torch.uint8, device=device)
    buf = out[: meta.nbytes]
    for (_, t), off in zip(named, meta.offsets):
        n = t.numel() * t.element_size()
        buf[off: off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return meta, buf


def unpack(meta: BucketMeta, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views into `buf` (uint8 [>= meta.nbytes]) with the names, dtypes and shapes of `meta`:
    no copy, so the caller must be done with them before reusing `buf`."""
    if buf.dtype != torch.uint8 or buf.numel() < meta.nbytes:
        raise ValueError(f"unpack: need a uint8 buffer of {meta.nbytes} bytes, got {buf.dtype} "
                         f"[{buf.numel()}]")
    out = []
    for name, dt, shape, off in zip(meta.names, meta.dtype_names, meta.shapes, meta.offsets):
        dtype = _dtype(dt)
        n = _numel(shape) * dtype.itemsize
        out.append((name, buf[off: off + n].view(dtype).view(shape)))
    return out


class BufferPool:
    """Reusable uint8 buffers for packed buckets. A fresh buffer pays a page fault on every
    byte: packing into one ran at 1.3 GB/s, into a reused one at 6.7 GB/s (bench/RESULTS.md).
    The sender gives a buffer back once its broadcast is done; thread-safe."""

    def __init__(self, keep: int = 2):
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.keep = keep                 # free buffers kept at most (the smallest go first)

    def take(self, nbytes: int, device) -> torch.Tensor:
        """A buffer of at least `nbytes` on `device` (the smallest free one that fits)."""
        device = torch.device(device)
        with self._lock:
            # by position, never list.remove: tensors compare elementwise
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes and b.device == device]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer (or a view of one, as `pack` yields) for reuse."""
        base = buf._base if buf._base is not None else buf
        with self._lock:
            self._free.append(base)
            if len(self._free) > self.keep:
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))


class ReceiveBuffers:
    """An engine worker's receive buffers, reused once nothing else holds a view of them.

    Receiving into a fresh buffer pays a page fault per byte (a gloo receive ran at 0.9 GB/s
    into fresh memory, 2.3 GB/s into touched memory: bench/RESULTS.md). But the buffer cannot
    simply be handed back after `load_weights`: vLLM's layerwise reload keeps views of the
    loaded tensors until their layer is complete, which may be a later bucket, and a weight
    loader may keep a view for good. So a buffer is reused only when its storage has no user
    but this pool (torch's storage use count); otherwise a new one is made. At most `keep`
    buffers are kept (the ones in use by the reload count too)."""

    def __init__(self, keep: int = 3):
        self.keep = keep
        self._bufs: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 CPU tensor of exactly `nbytes` (a view of a kept buffer when one is free)."""
        idle = [i for i, b in enumerate(self._bufs) if unshared(b)]
        fits = [i for i in idle if self._bufs[i].numel() >= nbytes]
        if fits:
            return self._bufs[min(fits, key=lambda i: self._bufs[i].numel())][:nbytes]
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if len(self._bufs) >= self.keep and idle:    # make room: drop the smallest idle one
            self._bufs.pop(min(idle, key=lambda i: self._bufs[i].numel()))
        if len(self._bufs) < self.keep:
            self._bufs.append(buf)
        return buf[:nbytes]      # always a view: the caller's hold is one more storage user

    def clear(self) -> None:
        self._bufs = []


def unshared(buf: torch.Tensor) -> bool:
    """No tensor but `buf` itself uses its storage (no view of it is alive anywhere). False
    when this torch cannot tell: the caller then makes a new buffer, never a wrong reuse."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None or buf._base is not None:
        return False
    # the temporary storage object below is one more user, the tensor itself the other
    return count(buf.untyped_storage()._cdata) == 2
