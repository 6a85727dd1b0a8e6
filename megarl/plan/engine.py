"""The engines' share of a plan: bytes per vLLM engine GPU (weights, KV cache, workspace, and a
staged update's staging area) within rollout.engines.gpu_memory_utilization, and the weight
transfer's buffers outside it."""
from __future__ import annotations

import math

from megarl.config.schema import ClusterConfig, RootConfig
from megarl.models.arch import Arch
from megarl.plan import lora as plan_lora
from megarl.plan import memory as mem
from megarl.plan.memory import GiB
from megarl.plan.transfer import engine_transfer_buffers, staging_bytes, staging_place


def engine_memory(cfg: RootConfig, arch: Arch, cluster: ClusterConfig, engines: int, engine_tp: int) -> dict:
    """Bytes per engine GPU. vLLM fills its share (rollout.engines.gpu_memory_utilization) with
    weights (and with weight_sync.lora=adapters its LoRA slot), workspace and KV cache when it
    starts; the weight transfer's buffers are allocated later, at each sync, so they must fit in
    what vLLM leaves outside its share, less the reserve."""
    r = cfg.rollout
    # sync mode submits every sample of the step at once; partial keeps `concurrency` in flight;
    # the agent service at most one call per open episode
    in_flight = {"sync": cfg.samples_per_step, "service": cfg.service.max_episodes}.get(r.mode, r.partial.concurrency)
    per_engine = math.ceil(in_flight / engines)
    kv_tok = mem.kv_bytes_per_token(arch, engine_tp)
    lora = cfg.model.lora
    b = {"weights": mem.engine_weight_bytes(arch, engine_tp),
         # weight_sync.lora=adapters: vLLM serves base + adapters, one LoRA slot (max_loras=1) of
         # rank model.lora.rank, its A / B split over the engine's TP as megatron splits them
         "lora": plan_lora.peft_params(arch, lora.rank, lora.targets, engine_tp) * 2
         if plan_lora.adapters_pushed(cfg) else 0,
         "kv_cache": per_engine * r.engines.max_model_len * kv_tok,
         "workspace": mem.engine_workspace_bytes(arch, engine_tp, per_engine,
                                                 expert_parallel=r.engines.expert_parallel)}
    total = cluster.gpu_mem_gb * GiB
    budget = min(r.engines.gpu_memory_utilization * total, total - cluster.reserve_gb * GiB)
    transfer = engine_transfer_buffers(cfg, arch)   # none with ipc: the engine reads the trainer's
    room = total - r.engines.gpu_memory_utilization * total - cluster.reserve_gb * GiB
    transfer_fits = not transfer or transfer <= room
    # weight_sync.staged on a GPU wire: the next version's slice beside the weights, in the
    # budget (it takes what would be KV cache). The GPU wires do not stage yet (nccl / ipc pause
    # for the whole push, run.py WeightSyncConfig.staged), so it is checked but not counted in
    # `fits`: `staging_fits` says whether the staged design would fit this engine
    staging = staging_bytes(cfg, arch) if staging_place(cfg) == "gpu" else 0.0
    return {"per_gpu_bytes": b, "need_bytes": sum(b.values()), "budget_bytes": budget,
            "requests_per_engine": per_engine, "kv_bytes_per_token_per_gpu": kv_tok,
            "transfer_bytes": transfer, "transfer_room_bytes": room,
            "staging_bytes": staging, "staging_fits": sum(b.values()) + staging <= budget,
            "fits": sum(b.values()) <= budget and transfer_fits}
