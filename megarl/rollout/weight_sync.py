"""Trainer -> engines weight sync: the trainer-side source, and the seam to the transports.

Each PP stage converts its own layers (layer numbers offset by stage). Within a stage the TP
ranks all-gather each parameter on its partition dimension; the mapping table (shared with the
HF <-> Megatron tools) turns megatron's layouts into HF's: fused QKV split by GQA group, fc1
split into gate and up per TP rank, vocab padding removed. `hf_tensors` yields a stage's HF
tensors, `buckets` groups them, `sender_buckets` packs them and brings every stage's buckets
to global rank 0, the one sender.

How they reach the engines is `weight_sync.transport` (megarl/rollout/transfer/): `collective`
(one broadcast to every engine worker, nothing on disk) or `files` (staged safetensors).
`open_transport` picks one; its `push(model, info, version)` is collective over all ranks.
"""
from __future__ import annotations

import math
import time
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from megarl.conversion.mapping import mapping_for
from megarl.distributed import parallel
from megarl.models.builders import ModelInfo, use_te


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


def sender_buckets(model, info: ModelInfo, bucket_bytes: int, timers: dict | None = None):
    """Every stage's HF tensors as packed buckets `(BucketMeta, uint8 buffer)`, yielded on
    global rank 0 only, stage 0 first. Collective: each stage's TP ranks gather in lockstep
    (DP replicas > 0 hold the same weights and sit out); a stage > 0 relays its buckets to
    rank 0 over the trainer's world group (a header object, then the bytes, then None).
    `timers` accumulates "gather", "convert" and "pack" seconds."""
    from megarl.rollout.transfer import packing
    timers = timers if timers is not None else {}
    if parallel.dp_rank() != 0:
        return
    lead = parallel.tp_rank() == 0
    own = buckets(hf_tensors(model, info, timers), bucket_bytes)

    def packed():
        for b in own:
            t = time.perf_counter()
            out = packing.pack(list(b.items())) if lead else None
            timers["pack"] = timers.get("pack", 0.0) + time.perf_counter() - t
            yield out
    stages = dist.get_process_group_ranks(parallel.pp_group()) if parallel.pp_size() > 1 else [0]
    me = dist.get_rank() if dist.is_initialized() else 0
    if me == 0:
        yield from packed()
        for src in stages[1:]:            # the other stages, one after another
            while True:
                header = [None]
                dist.recv_object_list(header, src=src)
                if header[0] is None:
                    break
                meta = packing.BucketMeta(**header[0])
                buf = torch.empty(meta.nbytes, dtype=torch.uint8, device=_device())
                dist.recv(buf, src=src)
                yield meta, buf
    elif lead:
        for meta, buf in packed():
            dist.send_object_list([meta.to_dict()], dst=0)
            dist.send(buf, dst=0)
        dist.send_object_list([None], dst=0)
    else:
        for _ in packed():               # TP peers: only the gathers
            pass


def _device() -> torch.device:
    from megarl.distributed import device
    return device.current()


def open_transport(ws, pool):
    """The transport of `ws` (a WeightSyncConfig), on every trainer rank; `pool` is the
    SyncPool on global rank 0, None elsewhere."""
    if ws.transport == "files":
        from megarl.rollout.transfer.files import FilesTransport
        return FilesTransport(ws, pool)
    from megarl.rollout.transfer.collective import CollectiveTransport
    return CollectiveTransport(ws, pool)


def stage_bytes(model) -> int:
    """Bytes this rank's stage writes per sync: its parameters at full (TP-gathered) size."""
    tp = parallel.tp_size()
    return sum(p.numel() * p.element_size() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
               for p in unwrap(model).parameters())


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
    # NaN first: an engine whose probe returned no tokens has gap 0/0 = NaN, and NaN > tol is False
    name, gap = max(gaps.items(), key=lambda kv: math.inf if math.isnan(kv[1]) else kv[1])
    if math.isnan(gap):
        raise WeightSyncError(
            f"engine {name} returned no tokens (or NaN logprobs) for the weight-sync verify probe: the "
            f"push cannot be checked; see the engine's log (weight_sync.verify=false skips the check)")
    if gap > tol:
        version = pool.version if pool is not None else "?"
        raise WeightSyncError(
            f"engine {name} logprobs differ from the trainer's by {gap:.3g} (> {tol}) at weight "
            f"version {version}: the push did not reach the engine (or the mapping is wrong); "
            f"check weight_sync.staging_dir and the conversion table")
    return gap
