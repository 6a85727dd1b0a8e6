"""The adapters-only weight push (weight_sync.lora=adapters, docs/lora.md "What travels"): the
trainer side. Only the LoRA adapters travel, as PEFT tensors (formats/lora_peft.py); the engines
keep the base weights they loaded from model.path (the trainer's base is frozen) and swap the
adapters into vLLM's LoRA slot under one adapter id (rollout/engines/lora_slots.py, in the workers).

A push is collective over every trainer rank, as `source.sender_buckets`: each stage's TP ranks
all-gather their adapter shards (DP replicas > 0 hold the same ones and sit out), the TP lead of
each stage converts its layers (global layer numbers) and the stages' tensors reach global rank 0
with one object gather over the PP group (megabytes, not the model: no bucket relay), which
packs them into buckets for the wire. Each bucket's update info carries `spec` (ADAPTER_KEY):
the adapter's id, rank and alpha, which tells the engine side these are adapters to swap in,
not weights to load.

Routes: the collective transport on megarl's gloo wire, unstaged and unsharded (the adapters
are small; the engines pause for the receive and the swap). vLLM's nccl and ipc receivers load
every tensor into the model itself and the files route reloads weights from a folder: both are
refused (`check_route`).
"""
from __future__ import annotations

import time
from typing import Iterator

import torch
import torch.distributed as dist

from megarl.distributed import parallel
from megarl.formats import lora_peft
from megarl.formats.mapping import mapping_for
from megarl.models.builders import ModelInfo
from megarl.models.lora import LoRALinear, lora_layers
from megarl.rollout.engines.vllm_settings import ADAPTER_ID, ADAPTER_KEY, ADAPTER_NAME  # noqa: F401 (collective.py)
from megarl.rollout.weights import packing, source


def wanted(ws, model) -> bool:
    """Whether a push of `model` sends only its adapters: weight_sync.lora=adapters and the actor
    has LoRA layers (every trainer rank answers alike)."""
    if getattr(ws, "lora", "merged") != "adapters":
        return False
    module = source.unwrap(model)
    return isinstance(module, torch.nn.Module) and next(lora_layers(module), None) is not None


def check_route(ws, wire_name: str) -> None:
    """The routes that cannot carry adapters, one line each (the engines would be left on the
    base weights): WeightSyncConfig.adapters_refusal, as the config and preflight refuse them."""
    refusal = ws.adapters_refusal(wire_name)
    if refusal:
        raise ValueError(refusal)


def spec(model) -> dict:
    """The adapter every engine serves: id, name, rank and alpha (from the actor's layers)."""
    layer = next(lora_layers(source.unwrap(model)))
    return {"id": ADAPTER_ID, "name": ADAPTER_NAME, "r": int(layer.rank), "alpha": float(layer.scale * layer.rank)}


def peft_tensors(model, info: ModelInfo, timers: dict | None = None) -> dict[str, torch.Tensor]:
    """This stage's adapters as PEFT tensors (TP gathered; global layer numbers), on the stage's
    TP rank 0 ({} on its other ranks). Every TP rank of the stage must call it."""
    table = mapping_for(info.hf_config)
    timers = timers if timers is not None else {}
    tp = parallel.tp_size()
    out: dict[str, torch.Tensor] = {}
    for module_name, layer in source.unwrap(model).named_modules():
        if not isinstance(layer, LoRALinear):
            continue
        t0 = time.perf_counter()
        a, b = (_shards(p, tp) for p in (layer.lora_a, layer.lora_b))
        t1 = time.perf_counter()
        if parallel.tp_rank() == 0:
            out.update({k: v.cpu() for k, v in lora_peft.to_peft(table, module_name, a, b, info.layer_offset).items()})
        timers["gather"] = timers.get("gather", 0.0) + t1 - t0
        timers["convert"] = timers.get("convert", 0.0) + time.perf_counter() - t1
    return out


def _shards(param, tp: int) -> list[torch.Tensor]:
    """Every TP rank's copy of `param` (one tensor where it is replicated)."""
    data = param.detach()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return [data]
    shards = [torch.empty_like(data) for _ in range(tp)]
    dist.all_gather(shards, data.contiguous(), group=parallel.tp_group())
    return shards


def gathered(model, info: ModelInfo, timers: dict | None = None) -> dict[str, torch.Tensor] | None:
    """Every stage's PEFT tensors on global rank 0 (None on the other ranks). Collective."""
    if parallel.dp_rank() != 0:
        return None
    own = peft_tensors(model, info, timers)
    if parallel.pp_size() > 1 and parallel.tp_rank() == 0:
        group = parallel.pp_group()
        stages = dist.get_process_group_ranks(group)
        got = [None] * len(stages) if dist.get_rank() == stages[0] else None
        dist.gather_object(own, got, dst=stages[0], group=group)
        if got is not None:
            own = {k: v for stage in got for k, v in stage.items()}
    me = dist.get_rank() if dist.is_initialized() else 0
    return own if me == 0 else None


def sender_buckets(model, info: ModelInfo, bucket_bytes: int, timers: dict | None = None,
                   buffers: packing.BufferPool | None = None) -> Iterator[tuple[packing.BucketMeta, torch.Tensor]]:
    """The adapters as packed buckets, yielded on global rank 0 only (collective: every rank
    iterates it, as `source.sender_buckets`)."""
    timers = timers if timers is not None else {}
    tensors = gathered(model, info, timers)
    if tensors is None:
        return
    for bucket in source.buckets(sorted(tensors.items()), bucket_bytes):
        t = time.perf_counter()
        named = list(bucket.items())
        reuse = buffers.take(packing.layout(named).nbytes, named[0][1].device) if buffers else None
        packed = packing.pack(named, out=reuse)
        timers["pack"] = timers.get("pack", 0.0) + time.perf_counter() - t
        yield packed

