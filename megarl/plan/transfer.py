"""The weight transfer's share of a plan: its packed GPU buffers (weight_sync.transport=
collective over NCCL) on the sending trainer GPU and every engine GPU, or what a sync over
files stages on disk instead."""
from __future__ import annotations

from megarl.config.schema import RootConfig
from megarl.models.arch import Arch
from megarl.plan import memory as mem
from megarl.plan.memory import gib


def transfer_buffers(cfg: RootConfig, arch: Arch) -> float:
    """GPU bytes of the weight transfer's packed buffers on one side: the sending trainer GPU
    (global rank 0) and every engine GPU each hold this much (`memory.transfer_buffer_bytes`).
    0 for weight_sync.transport=files (the weights are staged as files instead: see
    `staging_note`) and for backend=gloo (its buffers are host memory)."""
    ws = cfg.weight_sync
    if ws.transport != "collective" or ws.resolved_backend(cuda=True) != "nccl":
        return 0
    return mem.transfer_buffer_bytes(arch, ws.bucket_mb, ws.num_buffers, mem.DTYPE_BYTES[cfg.model.dtype])


def transfer_formula(cfg: RootConfig, arch: Arch) -> str:
    """How `transfer_buffers` came about, with the settings that set it, for the printed plan."""
    ws = cfg.weight_sync
    big = mem.largest_hf_tensor(arch) * mem.DTYPE_BYTES[cfg.model.dtype]
    return (f"weight_sync.num_buffers={ws.num_buffers} x (weight_sync.bucket_mb={ws.bucket_mb} MiB "
            f"+ largest tensor {gib(big)} GiB)")


def staging_note(cfg: RootConfig, arch: Arch) -> str:
    """What a sync over files needs on disk (not on a GPU): the whole model as safetensors,
    written by the trainer and read by every engine, every step."""
    ws = cfg.weight_sync
    size = mem.total_params(arch) * mem.DTYPE_BYTES[cfg.model.dtype]
    if ws.transport == "files":
        return (f"weight_sync.transport=files: every sync stages the whole model, {gib(size)} GiB, as files under "
                f"weight_sync.staging_dir={ws.staging_dir} (host memory for /dev/shm, else disk), which every engine "
                f"must reach (a shared file system on a cluster) and reads in full; no GPU transfer buffers")
    if ws.resolved_backend(cuda=True) == "gloo":
        return (f"weight_sync.backend=gloo: the transfer's buffers ({transfer_formula(cfg, arch)}) are host memory "
                f"on global rank 0 and on every engine worker, not counted on the GPUs")
    return ""
