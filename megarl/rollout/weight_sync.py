"""Trainer -> engine weight sync: TP shards -> full HF-named tensors -> buckets -> engine.

Each PP stage converts its own layers (layer numbers offset by stage) in parallel. Within a
stage the TP ranks all-gather each parameter on its partition dimension; the mapping table
(shared with the HF <-> Megatron tools) turns megatron's layouts into HF's: fused QKV split by
GQA group, fc1 split into gate and up per TP rank, vocab padding removed.
CPU route: the stage's TP-rank-0 / DP-rank-0 writes its buckets as safetensors files into a
staging folder in shared memory; rank 0's engine reloads them all at once.
GPU route (NCCL broadcast into vLLM's weight-transfer engine) uses the same buckets.
"""
from __future__ import annotations

import os
import shutil
import time
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megarl.conversion.mapping import mapping_for
from megarl.distributed import parallel
from megarl.models.builders import ModelInfo, use_te


def unwrap(model):
    """The GPTModel inside megatron's DDP wrapper (parameter names without `module.`)."""
    return getattr(model, "module", model)


def hf_tensors(model, info: ModelInfo) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's parameters as full HF tensors (TP gathered). All TP ranks must iterate."""
    table = mapping_for(info.hf_config, te_names=use_te())
    tp = parallel.tp_size()
    for name, param in unwrap(model).named_parameters():
        data = param.detach()
        if tp > 1 and getattr(param, "tensor_model_parallel", False):
            shards = [torch.empty_like(data) for _ in range(tp)]
            dist.all_gather(shards, data.contiguous(), group=parallel.tp_group())
        else:
            shards = [data]
        yield from table.megatron_to_hf(name, shards, info.layer_offset).items()


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[dict]:
    """Group tensors into dicts of about `bucket_bytes` (a tensor larger than that is alone)."""
    bucket, size = {}, 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t.contiguous()
        size += nbytes
    if bucket:
        yield bucket


def staging_dir(base: str, tag: str) -> str:
    """A folder all ranks agree on (rank 0 picks it)."""
    choice = [os.path.join(base, f"megarl-weights-{tag}-{os.getpid()}")]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(choice, src=0)
    return choice[0]


def push(model, info: ModelInfo, engine, version: int, folder: str, bucket_mb: int) -> dict:
    """Send the actor's current weights to `engine` (on global rank 0) as `version`.

    Collective over all trainer ranks. Returns timings and the bytes sent (rank 0).
    """
    t0 = time.perf_counter()
    writer = parallel.tp_rank() == 0 and parallel.dp_rank() == 0
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
    dist.barrier()
    nbytes = 0
    for k, bucket in enumerate(buckets(hf_tensors(model, info), bucket_mb << 20)):
        if writer:
            save_file(bucket, os.path.join(folder, f"stage{parallel.pp_rank():03d}-{k:05d}.safetensors"))
            nbytes += sum(t.numel() * t.element_size() for t in bucket.values())
    dist.barrier()  # every stage's files are on disk
    reload_s = 0.0
    if engine is not None:
        reload_s = engine.load_weights(path=folder, version=version)
        shutil.rmtree(folder, ignore_errors=True)
    dist.barrier()
    return {"sync_time_s": time.perf_counter() - t0, "sync_reload_s": reload_s, "sync_bytes": nbytes}


class WeightSyncError(RuntimeError):
    """The engine's policy is not the trainer's after a push."""


def engine_mismatch(actor, engine, prompts: list[list[int]], max_tokens: int, micro_batch_size: int) -> float:
    """Mean |engine logprob - trainer logprob| over tokens the engine samples now (fp32: ~1e-6
    when the engine holds the trainer's weights). Collective over all trainer ranks."""
    from megarl.ppo import actor as actor_ops
    from megarl.ppo.batch import build_batch
    from megarl.rollout.types import Sample

    samples = None
    if engine is not None:
        outs = engine.generate(prompts, 1, max_tokens)
        samples = [Sample(p, g[0].token_ids, g[0].logprobs, [engine.version] * len(g[0].token_ids),
                          g[0].finished, i) for i, (p, g) in enumerate(zip(prompts, outs))]
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [samples]
        dist.broadcast_object_list(box, src=0)
        samples = box[0]
    batch = build_batch(samples, pad_id=0)
    mbs = micro_batch_size if batch.size % micro_batch_size == 0 else 1
    trainer = actor_ops.logprobs(actor.model, batch, mbs, actor.info.vocab_size)
    mask = batch.resp_mask
    return float(((trainer - batch.behav_logp).abs() * mask).sum() / mask.sum())


def verify(actor, engine, prompts, max_tokens: int, micro_batch_size: int, tol: float = 1e-3) -> float:
    """Raise WeightSyncError when the engine's logprobs differ from the trainer's by more than tol."""
    gap = engine_mismatch(actor, engine, prompts, max_tokens, micro_batch_size)
    if gap > tol:
        version = engine.version if engine is not None else "?"
        raise WeightSyncError(
            f"engine logprobs differ from the trainer's by {gap:.3g} (> {tol}) at weight version "
            f"{version}: the push did not reach the engine (or the mapping is wrong); check "
            f"weight_sync.staging_dir and the conversion table")
    return gap
