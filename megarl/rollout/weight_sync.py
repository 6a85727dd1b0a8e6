"""Trainer -> engines weight sync: TP shards -> full HF-named tensors -> buckets -> every engine.

Each PP stage converts its own layers (layer numbers offset by stage) in parallel. Within a
stage the TP ranks all-gather each parameter on its partition dimension; the mapping table
(shared with the HF <-> Megatron tools) turns megatron's layouts into HF's: fused QKV split by
GQA group, fc1 split into gate and up per TP rank, vocab padding removed.

CPU route: each stage's TP-rank-0 / DP-rank-0 writes its buckets as safetensors files into
one staging folder (owner-only, in shared memory by default) that every engine process can
read; rank 0 then has the pool load it into every engine at once (abort, pause, reload,
prefix-cache reset, resume), and the folder is removed, also when anything fails. Folders
left by a crashed run (their pid is gone) are removed at start.
GPU route (NCCL broadcast into vLLM's weight-transfer engine) uses the same buckets.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megarl.config import ConfigError
from megarl.conversion.mapping import mapping_for
from megarl.distributed import device, faults, parallel
from megarl.models.builders import ModelInfo, use_te
from megarl.rollout.reaper import remove_stale

PREFIX = "megarl-weights-"


def unwrap(model):
    """The GPTModel inside megatron's DDP wrapper (parameter names without `module.`)."""
    return getattr(model, "module", model)


def hf_tensors(model, info: ModelInfo, timers: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's parameters as full HF tensors (TP gathered). All TP ranks must iterate.
    `timers` (optional) accumulates seconds spent in "gather" and "convert"."""
    table = mapping_for(info.hf_config, te_names=use_te())
    tp = parallel.tp_size()
    timers = timers if timers is not None else {}
    for name, param in unwrap(model).named_parameters():
        t0 = time.perf_counter()
        data = param.detach()
        if tp > 1 and getattr(param, "tensor_model_parallel", False):
            shards = [torch.empty_like(data) for _ in range(tp)]
            dist.all_gather(shards, data.contiguous(), group=parallel.tp_group())
        else:
            shards = [data]
        t1 = time.perf_counter()
        converted = table.megatron_to_hf(name, shards, info.layer_offset)
        timers["gather"] = timers.get("gather", 0.0) + t1 - t0
        timers["convert"] = timers.get("convert", 0.0) + time.perf_counter() - t1
        yield from converted.items()


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[dict]:
    """Group tensors into dicts of about `bucket_bytes` (a tensor larger than that is alone)."""
    bucket, size = {}, 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t.contiguous()   # on the trainer's device; staged from the host
        size += nbytes
    if bucket:
        yield bucket


def clean_stale(base: str) -> list[str]:
    """Remove staging folders under `base` whose owning process is gone (a crashed run's
    weights would otherwise sit in shared memory until reboot). Returns what was removed."""
    return remove_stale(base, PREFIX)


def stage_bytes(model) -> int:
    """Bytes this rank's stage writes per sync: its parameters at full (TP-gathered) size."""
    tp = parallel.tp_size()
    return sum(p.numel() * p.element_size() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
               for p in unwrap(model).parameters())


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
    need = torch.tensor([stage_bytes(model) if writes else 0], dtype=torch.float64)
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
        for k, bucket in enumerate(buckets(hf_tensors(model, info, timers), bucket_mb << 20)):
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
            pool.update_weights(folder, version)
            load_s = time.perf_counter() - t
    finally:
        if not dist.is_initialized() or dist.get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
    dist.barrier()
    return {"sync_time_s": time.perf_counter() - t0, "sync_gather_s": timers.get("gather", 0.0),
            "sync_convert_s": timers.get("convert", 0.0), "sync_stage_s": stage_s,
            "sync_load_s": load_s, "sync_bytes": nbytes}


class WeightSyncError(RuntimeError):
    """The engine's policy is not the trainer's after a push."""


def engine_mismatch(actor, pool, prompts: list[list[int]], max_tokens: int, micro_batch_size: int,
                    temperature: float = 1.0) -> dict[str, float]:
    """Per engine of `pool`: mean |engine logprob - trainer logprob| over tokens that engine
    samples now at `temperature` (fp32: ~1e-6 when it holds the trainer's weights).
    Collective over all trainer ranks; `pool` is a SyncPool on global rank 0, None elsewhere."""
    from megarl.ppo import actor as actor_ops
    from megarl.ppo.batch import build_batch
    from megarl.rollout.engine import GenRequest
    from megarl.rollout.types import Sample

    per_engine = None
    if pool is not None:
        per_engine = {}
        for e in pool.engines:
            reqs = [GenRequest(f"probe-{e.name}-{i}", p, max_tokens, temperature, seed=i)
                    for i, p in enumerate(prompts)]
            outs = pool.call(_on_engine(pool.pool, e, reqs), f"probing {e.name}")
            per_engine[e.name] = [Sample(p, r.token_ids, r.logprobs, r.versions, r.finished, i)
                                  for i, (p, r) in enumerate(zip(prompts, outs))]
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [per_engine]
        dist.broadcast_object_list(box, src=0)
        per_engine = box[0]
    gaps = {}
    for name, samples in per_engine.items():
        batch = build_batch(samples, pad_id=0)
        mbs = micro_batch_size if batch.size % micro_batch_size == 0 else 1
        trainer = actor_ops.logprobs(actor.model, batch, mbs, actor.info.vocab_size, temperature)
        mask = batch.resp_mask
        gaps[name] = float(((trainer - batch.behav_logp).abs() * mask).sum() / mask.sum())  # one sync per engine
    return gaps


async def _on_engine(pool, engine, reqs):
    import asyncio
    return await asyncio.gather(*(pool.generate(r, engine) for r in reqs))


def verify(actor, pool, prompts, max_tokens: int, micro_batch_size: int, temperature: float = 1.0,
           tol: float = 1e-3) -> float:
    """Raise WeightSyncError when any engine's logprobs differ from the trainer's by more
    than tol; returns the largest gap."""
    gaps = engine_mismatch(actor, pool, prompts, max_tokens, micro_batch_size, temperature)
    name, gap = max(gaps.items(), key=lambda kv: kv[1])
    if gap > tol:
        version = pool.version if pool is not None else "?"
        raise WeightSyncError(
            f"engine {name} logprobs differ from the trainer's by {gap:.3g} (> {tol}) at weight "
            f"version {version}: the push did not reach the engine (or the mapping is wrong); "
            f"check weight_sync.staging_dir and the conversion table")
    return gap
