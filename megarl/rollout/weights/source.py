"""The trainer side of a weight sync: the actor's shards as full HF tensors, in packed buckets.
With LoRA (model.lora.rank > 0, weight_sync.lora=merged) each adapted weight is sent merged,
W + (alpha / r) B A under the base's name, so the engines sample from the adapted policy.

Each PP stage converts its own layers (layer numbers offset by stage). Within a stage the TP
ranks all-gather each parameter on its partition dimension; the mapping table (shared with the
HF <-> Megatron tools) turns megatron's layouts into HF's: fused QKV split by GQA group, fc1
split into gate and up per TP rank, vocab padding removed. `hf_tensors` yields a stage's HF
tensors, `buckets` groups them, `sender_buckets` packs them and brings every stage's buckets
to global rank 0, the one sender of the collective transport. A stage whose own part fails
(a mapping error, say) still ends its relay, with an error marker: rank 0 raises `StageError`
naming it only once every stage has been read to its end, so no rank is left blocked.
"""
from __future__ import annotations

import time
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from megarl.distributed import device, parallel
from megarl.formats.mapping import mapping_for
from megarl.models.builders import ModelInfo, use_te
from megarl.models.lora import merged_parameters
from megarl.rollout.weights import packing


class StageError(RuntimeError):
    """Global rank 0: a PP stage's own part of a weight push (gather, conversion, packing)
    failed; names each failed stage and its first rank, with the error."""


def unwrap(model):
    """The GPTModel inside megatron's DDP wrapper (parameter names without `module.`)."""
    return getattr(model, "module", model)


def joins_gathers() -> bool:
    """Whether this rank takes part in a push's gathers: DP replica 0's ranks, and with expert
    parallelism the other ranks of their expert groups (they hold the other experts)."""
    return parallel.dp_rank() == 0 or (parallel.ep_size() > 1 and parallel.edp_rank() == 0)


def hf_tensors(model, info: ModelInfo, timers: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's parameters as full HF tensors (with LoRA each adapted weight merged,
    W + (alpha / r) B A, per TP shard before the gather: models/lora.py `merged_parameters`;
    TP gathered; with expert parallelism each
    expert tensor gathered from its EP owner, one local expert at a time, so no rank holds
    more than `ep` copies of one expert's tensor). All TP ranks, and the EP ranks of an
    expert group, must iterate (`joins_gathers`). `timers` (optional) accumulates seconds
    spent in "gather" and "convert"."""
    table = mapping_for(info.hf_config, te_names=use_te())
    tp, ep = parallel.tp_size(), parallel.ep_size()
    local_experts = (info.config.num_moe_experts or 0) // ep
    timers = timers if timers is not None else {}
    for name, param, data in merged_parameters(unwrap(model)):
        t0 = time.perf_counter()
        owners = _gathered(param, tp, ep, data)
        t1 = time.perf_counter()
        converted = {}
        for g, owner in enumerate(owners):
            start = info.expert_offset if len(owners) == 1 else g * local_experts
            converted.update(table.megatron_to_hf(name, owner, info.layer_offset, start))
        timers["gather"] = timers.get("gather", 0.0) + t1 - t0
        timers["convert"] = timers.get("convert", 0.0) + time.perf_counter() - t1
        yield from converted.items()


def _is_expert(param) -> bool:
    """An expert's tensor: megatron marks them allreduce=False (reduced over the expert-data
    group, not the whole DP group)."""
    return not getattr(param, "allreduce", True)


def _gathered(param, tp: int, ep: int, data: torch.Tensor | None = None) -> list[list[torch.Tensor]]:
    """`param`'s TP shards (one tensor where it is not TP-split), per EP owner: an expert's
    tensor is its EP peers' same local expert too, after each one's own TP gather (one list per
    peer, in EP rank order); any other tensor is this rank's alone (one list). `data`: what to
    gather in its place (a LoRA layer's merged shard; default the parameter itself)."""
    data = param.detach() if data is None else data
    if tp > 1 and getattr(param, "tensor_model_parallel", False):
        shards = [torch.empty_like(data) for _ in range(tp)]
        dist.all_gather(shards, data.contiguous(), group=parallel.tp_group())
    else:
        shards = [data]
    if ep == 1 or not _is_expert(param):
        return [shards]
    full = shards[0] if len(shards) == 1 else None
    stacked = torch.stack(shards) if full is None else full
    gathered = [torch.empty_like(stacked) for _ in range(ep)]
    dist.all_gather(gathered, stacked.contiguous(), group=parallel.ep_group())
    return [[g] if full is not None else list(g.unbind(0)) for g in gathered]


def expert_gathers(model) -> None:
    """This rank's part of a stage's expert gathers, for the ranks of an expert group outside DP
    replica 0 (`joins_gathers`): each expert tensor's TP and EP gathers, in the order replica
    0's ranks run them in `hf_tensors`; nothing converted or kept. Their other tensors are
    gathered by no one: replica 0 holds them, and a TP group lies within one replica."""
    tp, ep = parallel.tp_size(), parallel.ep_size()
    for param in unwrap(model).parameters():
        if _is_expert(param):
            _gathered(param, tp, ep)


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


def sender_buckets(model, info: ModelInfo, bucket_bytes: int, timers: dict | None = None,
                   buffers: packing.BufferPool | None = None):
    """Every stage's HF tensors as packed buckets `(BucketMeta, uint8 buffer)`, yielded on
    global rank 0 only, stage 0 first. Collective: each stage's TP ranks gather in lockstep
    (DP replicas > 0 hold the same weights and sit out); a stage > 0 relays its buckets to
    rank 0 over the trainer's world group (a header object, then the bytes, then None).
    `buffers`: where rank 0's buckets are packed and received (the consumer gives each back
    when it is done with it); `timers` accumulates "gather", "convert" and "pack" seconds.
    If a stage's own part raises, its ranks raise that error once their relay has ended; rank 0
    reads every stage to its end marker, then raises `StageError` naming each failed stage."""
    timers = timers if timers is not None else {}
    if not joins_gathers():
        return
    if parallel.dp_rank() != 0:          # an expert group's other ranks: only the expert gathers
        expert_gathers(model)
        return
    lead = parallel.tp_rank() == 0
    me = dist.get_rank() if dist.is_initialized() else 0
    # rank 0 packs into the consumer's reusable buffers; a relaying stage packs whole tensors
    # (torch.distributed's send and recv take no view of a larger buffer)
    pool = buffers if me == 0 else None
    own = buckets(hf_tensors(model, info, timers), bucket_bytes)
    failed: list[Exception] = []         # this stage's own error (the same on its TP ranks)

    def packed():
        # an error of this stage's own part ends its buckets, but not the relay: rank 0 must
        # still read every other stage to its end, or they stay blocked in their sends
        try:
            for b in own:
                t = time.perf_counter()
                out = None
                if lead:
                    named = list(b.items())
                    reuse = pool.take(packing.layout(named).nbytes, named[0][1].device) if pool else None
                    out = packing.pack(named, out=reuse)
                timers["pack"] = timers.get("pack", 0.0) + time.perf_counter() - t
                yield out
        except Exception as err:  # noqa: BLE001 - raised again below, once the relay has ended
            failed.append(err)
    stages = dist.get_process_group_ranks(parallel.pp_group()) if parallel.pp_size() > 1 else [0]
    if me == 0:
        yield from packed()
        errors = [f"stage 0 on rank 0: {_named(failed[0])}"] if failed else []
        yield from _relayed(stages, errors)
        if errors:
            raise StageError("preparing the weights failed: " + "; ".join(errors)) from (failed[0] if failed else None)
    elif lead:
        for meta, buf in packed():
            dist.send_object_list([meta.to_dict()], dst=0)
            dist.send(buf, dst=0)
        # the end marker, or this stage's error in its place: rank 0 stops reading this stage
        # either way (not waiting for buckets that never come) and names the error to all ranks
        dist.send_object_list([{"error": _named(failed[0])} if failed else None], dst=0)
    else:
        for _ in packed():               # TP peers: only the gathers
            pass
    if failed:                           # not rank 0: the push catches it and joins rank 0's outcome
        raise failed[0]


def _relayed(stages: list[int], errors: list[str]):
    """Rank 0: the buckets the other stages' leaders relay, one stage after another, each read
    to its end marker (None) or its error marker ({"error": ...}, added to `errors`). Once there
    is an error, buckets are still received (so their stage gets to its marker) but dropped:
    the push fails, sending more of it is wasted."""
    for stage, src in enumerate(stages[1:], start=1):
        while True:
            header = [None]
            dist.recv_object_list(header, src=src)
            if header[0] is None:
                break
            if "error" in header[0]:
                errors.append(f"stage {stage} on rank {src}: {header[0]['error']}")
                break
            meta = packing.BucketMeta(**header[0])
            buf = torch.empty(meta.nbytes, dtype=torch.uint8, device=_device())
            dist.recv(buf, src=src)
            if not errors:
                yield meta, buf


def _named(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _device() -> torch.device:
    return device.current()


def stage_bytes(model) -> int:
    """Bytes this rank's stage writes per sync: its parameters at full (TP-gathered) size, every
    expert (EP-gathered) included; with LoRA the merged base weights (no adapters)."""
    tp, ep = parallel.tp_size(), parallel.ep_size()
    return sum(t.numel() * t.element_size() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
               * (ep if _is_expert(p) else 1)
               for _, p, t in merged_parameters(unwrap(model)))
