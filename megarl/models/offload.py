"""Keep idle models off the accelerator: free their parameter (and gradient) storage between
the phases that use them, holding a host copy, so actor, critic and reference fit together.

The storage is resized to zero in place rather than swapped for new tensors: megatron's DDP
parameters are views into one contiguous buffer, and optimizers hold references to them, so
every view stays valid and sees the data again after `reload`. On a CPU-only machine the host
copy lives in the same memory, so nothing is saved there; the same code path still runs.
"""
from __future__ import annotations

import contextlib

import torch


def _storages(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors that own the model's memory: megatron DDP's flat buffers, or each
    parameter (deduplicated: tied weights share storage)."""
    buffers = getattr(model, "buffers", None)
    if isinstance(buffers, list):  # megatron DistributedDataParallel
        owned = []
        for buf in buffers + getattr(model, "expert_parallel_buffers", []):
            owned += [t for t in (buf.param_data, buf.grad_data) if t is not None]
        return owned
    seen, owned = set(), []
    for p in model.parameters():
        key = p.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            owned.append(p.data)
    return owned


class Offloader:
    def __init__(self, model: torch.nn.Module):
        self.tensors = _storages(model)
        self.host: list[torch.Tensor] | None = None

    @property
    def offloaded(self) -> bool:
        return self.host is not None

    def offload(self) -> None:
        if self.offloaded:
            return
        pin = torch.cuda.is_available()
        self.host = []
        for t in self.tensors:
            copy = t.detach().to("cpu", copy=True)
            self.host.append(copy.pin_memory() if pin else copy)
            t.untyped_storage().resize_(0)

    def reload(self) -> None:
        if not self.offloaded:
            return
        for t, copy in zip(self.tensors, self.host):
            t.untyped_storage().resize_(copy.numel() * copy.element_size())
            t.copy_(copy, non_blocking=False)
        self.host = None


def enable(model: torch.nn.Module) -> None:
    """Register `model` for offloading and offload it now."""
    model._megarl_offloader = Offloader(model)
    model._megarl_offloader.offload()


@contextlib.contextmanager
def resident(model: torch.nn.Module | None):
    """Bring an offloaded model back for the block, and offload it again after. A model never
    registered with `enable` is left alone."""
    offloader = getattr(model, "_megarl_offloader", None)
    if offloader is None:
        yield model
        return
    offloader.reload()
    try:
        yield model
    finally:
        offloader.offload()
