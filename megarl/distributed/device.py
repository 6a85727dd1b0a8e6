"""The one place that decides where megarl's tensors live.

On a GPU machine every trainer rank drives one GPU: `init_distributed` selects the local one
(LOCAL_RANK under torchrun, SLURM_LOCALID under srun) and `current()` returns it from then on.
Without a GPU it is the CPU (the shim in `cpu.py` maps megatron's hard-coded CUDA there).

Rule for the rest of the code: tensors built from Python data (the rollout batch, index
vectors, statistics for a collective) are built on the host and moved once with `put`;
tensors derived from another tensor take that tensor's device (`zeros_like`, `device=x.device`);
results for Python (metrics, samples) come back with `host_values`, once per step.
"""
from __future__ import annotations

from typing import Mapping

import torch


def current() -> torch.device:
    """The device this rank's models and batches are on."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def select(local_rank: int) -> torch.device:
    """Bind this process to its GPU (a no-op without one). Call once, before any model or
    NCCL communicator is built, so every later allocation lands on the right GPU."""
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"local rank {local_rank} has no GPU: this node shows "
                               f"{torch.cuda.device_count()}; launch at most that many ranks per node")
        torch.cuda.set_device(local_rank)
    return current()


def put(t: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """`t` on the trainer's device (non-blocking from pinned memory on GPU)."""
    device = device or current()
    # .to() returns `t` itself when it is there already; called anyway, so DeviceGuard sees
    # the placement on a CPU-only machine too
    return t.to(device, non_blocking=device.type == "cuda" and t.is_pinned())


def host_values(values: Mapping[str, torch.Tensor | float | int]) -> dict[str, float]:
    """Scalar tensors -> Python floats in one device-to-host copy (each `float(t)` on a GPU
    tensor is its own synchronisation). Plain numbers pass through."""
    names = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in values.items() if not isinstance(v, torch.Tensor)}
    if names:
        stacked = torch.stack([values[k].detach().reshape(()).double() for k in names])
        out.update(zip(names, stacked.cpu().tolist()))
    return out
