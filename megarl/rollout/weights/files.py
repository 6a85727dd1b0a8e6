"""files transport: safetensors staged in a folder every engine reads (`reload_weights`).

For servers started without megarl's weight-transfer config (weight_sync.transport=files).
Each stage's TP-rank-0 / DP-rank-0 writes its buckets as safetensors files into one staging
folder (owner-only, in shared memory by default) that every engine process can read; rank 0
then has the pool load it into every engine at once (abort, pause, reload, prefix-cache reset,
resume), and the folder is removed, also when anything fails. Folders left by a crashed run
(their pid is gone) are removed at start. On a cluster the folder must sit on a file system
the trainer and every engine node share: a 70B push is 140 GB written, then read by each.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megarl.config import ConfigError
from megarl.distributed import device, faults, parallel
from megarl.models.builders import ModelInfo
from megarl.rollout.engines.reaper import remove_stale
from megarl.rollout.weights import source

PREFIX = "megarl-weights-"


def clean_stale(base: str) -> list[str]:
    """Remove staging folders under `base` whose owning process is gone (a crashed run's
    weights would otherwise sit in shared memory until reboot). Returns what was removed."""
    return remove_stale(base, PREFIX)


def _staging_problem(base: str, need: int) -> str | None:
    if not os.path.isdir(base) or not os.access(base, os.W_OK):
        return (f"weight_sync.staging_dir={base!r}: not a writable folder: set it to one every rank "
                f"and engine can read (e.g. /dev/shm or a job-local tmp)")
    free = shutil.disk_usage(base).free
    if free < need * 1.05:
        return (f"weight_sync.staging_dir={base!r}: {free / 2**20:.0f} MiB free, a weight sync stages "
                f"{need / 2**20:.0f} MiB: point weight_sync.staging_dir at a larger file system that "
                f"every engine can read (or free space there)")
    return None


def check_staging_base(base: str) -> None:
    """Before a run writes anything: weight_sync.staging_dir is a writable folder."""
    problem = _staging_problem(base, 0)
    if problem:
        raise ConfigError(problem)


def staging_dir(base: str, tag: str, model=None) -> str:
    """Collective: a fresh owner-only folder all ranks agree on. Rank 0 checks that `base` is
    writable and can hold one full sync of `model`, removes stale folders, and creates it
    (named after its pid, so `clean_stale` can tell a crashed run's folders from a live one's).
    A problem raises the same ConfigError on every rank (no rank is left waiting)."""
    writes = model is not None and parallel.tp_rank() == 0 and parallel.dp_rank() == 0
    need = torch.tensor([source.stage_bytes(model) if writes else 0], dtype=torch.float64)
    multi = dist.is_initialized() and dist.get_world_size() > 1
    if multi:
        need = device.put(need)   # NCCL reduces device tensors only
        dist.all_reduce(need)
    choice = [None, None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        problem = _staging_problem(base, int(need.item()))
        if problem:
            choice = [None, problem]
        else:
            clean_stale(base)
            # mkdtemp creates the folder with mode 0700: other users cannot read the weights
            choice = [tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-{tag}-", dir=base), None]
    if multi:
        dist.broadcast_object_list(choice, src=0)
    if choice[1]:
        raise ConfigError(choice[1])
    return choice[0]


def push(model, info: ModelInfo, pool, version: int, base: str, bucket_mb: int, tag: str = "sync") -> dict:
    """Send the actor's current weights to every engine of `pool` (held by global rank 0;
    None elsewhere) as `version`. Collective over all trainer ranks.

    Returns timings (seconds: total, gather, convert, stage, load) and the bytes staged by
    this rank; the staging folder is gone when this returns, whether it succeeded or not.
    """
    t0 = time.perf_counter()
    folder = staging_dir(base, tag, model)
    writer = parallel.tp_rank() == 0 and parallel.dp_rank() == 0
    timers: dict[str, float] = {}
    nbytes, stage_s, load_s = 0, 0.0, 0.0
    try:
        for k, bucket in enumerate(source.buckets(source.hf_tensors(model, info, timers), bucket_mb << 20)):
            if writer:
                t = time.perf_counter()
                host = {name: tensor.cpu() for name, tensor in bucket.items()}   # one D2H copy each
                save_file(host, os.path.join(folder, f"stage{parallel.pp_rank():03d}-{k:05d}.safetensors"))
                stage_s += time.perf_counter() - t
                faults.point("sync_bucket")
                nbytes += sum(tensor.numel() * tensor.element_size() for tensor in host.values())
        dist.barrier()  # every stage's files are on disk
        if pool is not None:
            t = time.perf_counter()
            pool.reload_weights(folder, version)
            load_s = time.perf_counter() - t
    finally:
        if not dist.is_initialized() or dist.get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
    dist.barrier()
    return {"sync_time_s": time.perf_counter() - t0, "sync_gather_s": timers.get("gather", 0.0),
            "sync_convert_s": timers.get("convert", 0.0), "sync_stage_s": stage_s,
            "sync_load_s": load_s, "sync_bytes": nbytes}


class FilesTransport:
    """The files route behind the transport seam (weight_sync.open_transport)."""

    def __init__(self, ws, pool, tag: str = "sync"):
        self.ws, self.pool, self.tag = ws, pool, tag

    def push(self, model, info: ModelInfo, version: int) -> dict:
        return push(model, info, self.pool, version, self.ws.staging_dir, self.ws.bucket_mb, self.tag)

    def close(self) -> None:
        pass
