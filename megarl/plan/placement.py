"""`make_plan`: where every model goes on the recipe's cluster, its memory per GPU, and what
does not fit, each problem with the settings that fix it."""
from __future__ import annotations

import math
from dataclasses import asdict, replace

from megarl.config.schema import ClusterConfig, ConfigError, RootConfig, validate_world
from megarl.models.arch import Arch, resolve_arch
from megarl.plan import lora as plan_lora
from megarl.plan import memory as mem
from megarl.plan.engine import engine_memory
from megarl.plan.inputs import resolve_cluster, reward_arch
from megarl.plan.job import job_engines
from megarl.plan.memory import GiB, gib
from megarl.plan.node_split import one_node_split
from megarl.plan.trainer import (
    best_layout,
    check_expert_world,
    check_layout,
    expert_layout,
    layout_of,
    layout_setting,
    trainer_fixes,
    trainer_memory,
)
from megarl.plan.transfer import (
    plan_backend,
    push_bytes,
    staging_line,
    staging_note,
    transfer_buffers,
    transfer_formula,
)

FUSED = True   # GPU runs: Transformer Engine (fused norm + linear, flash attention), fused SwiGLU

ASSUMPTIONS = [
    "trainer: megatron DDP + distributed optimizer as models/builders.py builds it: weights (dtype), "
    "fp32 gradient buffer, Adam state (+ fp32 main weights for bf16) sharded over DP",
    "activations: Korthikanti et al. 2022 per layer (RMSNorm/SwiGLU/GQA, no dropout, TE fused kernels + "
    "flash attention), 1F1B in-flight micro-batches, sequence = rollout.engines.max_model_len (prompt + "
    "response bound)",
    "engine: bf16 weights / engine TP + KV cache 2 x layers x kv_heads x head_dim x 2 bytes per token "
    "for every in-flight request at rollout.engines.max_model_len, within rollout.engines.gpu_memory_utilization",
    "reserve per GPU (cluster.reserve_gb): CUDA context, NCCL buffers, allocator fragmentation",
    "MoE: experts / parallel.ep per GPU, each over expert TP (megatron's default: = TP); their Adam state sharded "
    "over expert DP = TP x DP / (EP x expert TP), the rest's over DP; routing balanced (dropless: a skewed router "
    "puts more tokens on a rank than counted), alltoall dispatcher buffers for the layer in flight",
    "weight_sync.transport=collective (nccl): weight_sync.num_buffers packed buffers of up to weight_sync.bucket_mb "
    "+ the largest tensor on global rank 0's GPU (in every phase: a safe bound) and on every engine GPU "
    "(outside vLLM's gpu_memory_utilization share, less the reserve); (ipc, engines on global rank 0's node) "
    "the whole model once more + those buffers on global rank 0's GPU, none on the engine GPUs",
    "LoRA (model.lora.rank > 0): the actor's base frozen, its weights only; the adapters (per TP rank as "
    "models/lora.py splits them) with gradients and Adam state; no reference copy (the actor with its adapters "
    "off); the critic likewise with model.lora.critic; activations as in full fine-tuning (a bound); "
    "weight_sync.lora=adapters pushes the PEFT adapters and adds one vLLM LoRA slot per engine GPU",
]


def make_plan(cfg: RootConfig, nodes: int | None = None, gpus_per_node: int | None = None,
              gpu_mem_gb: float | None = None) -> dict:
    """Placement and memory per GPU; raises ConfigError for a layout the code would refuse."""
    arch, arch_src = resolve_arch(cfg)
    rm_arch, rm_note = reward_arch(cfg, arch)
    cluster, notes = resolve_cluster(cfg, nodes, gpus_per_node, gpu_mem_gb)
    cfg = replace(cfg, cluster=cluster)   # the cluster planned (command line applied), for transfer.plan_backend
    cfg, job_note = job_engines(cfg, cluster)   # the servers a slurm job starts (plan/job.py)
    notes += [job_note] if job_note else []
    if rm_note and rm_arch is arch:
        notes.append(f"reward model: {rm_note}")
    check_placeable(cfg, arch, cluster)
    r, g = cfg.rollout, cluster.gpus_per_node
    engines, etp = r.engines.pool_size, r.engines.tp
    split = one_node_split(cfg)   # one node: the trainer's GPUs and each engine's (plan/node_split.py)
    own = split is not None and not split.shared
    if r.engines.mode != "remote" and not cluster.engine_nodes and not own:
        notes.append("cluster.engine_nodes=0: engines not placed on this cluster (rollout.engines.mode "
                     f"{r.engines.mode}); only the trainer is checked")
    trainer_gpus = len(split.trainer) if split else cluster.trainer_node_count * g
    engine_gpus = engines * etp if own else cluster.engine_nodes * g
    trainer, dp, problems = trainer_part(cfg, arch, cluster, rm_arch, notes, trainer_gpus)
    placement = {"trainer": {"nodes": cluster.trainer_node_count, "gpus": trainer_gpus,
                             "tp": cfg.parallel.tp, "pp": cfg.parallel.pp, "dp": dp},
                 "engines": {"nodes": cluster.engine_nodes, "gpus": engine_gpus, "count": engines,
                             "tp": etp, "gpus_used": engines * etp}}
    if split:
        placement["gpu_split"] = {"trainer": list(split.trainer), "engines": [list(e) for e in split.engines],
                                  "shared": split.shared, "line": split.describe()}
    if arch.moe:   # experts over EP x expert TP, their optimizer state over expert DP
        lay = layout_of(cfg, cfg.parallel.tp, cfg.parallel.pp, dp or 0)
        placement["trainer"].update(ep=lay.ep, etp=lay.etp, edp=lay.edp if dp else None)
    engine = None
    if cluster.engine_nodes or r.engines.mode == "remote" or own:
        engine, more = engine_part(cfg, arch, cluster, engine_gpus)
        problems += more
    notes += [n for n in (staging_note(cfg, arch), staging_line(cfg, arch)) if n]
    return {"fits": not problems, "problems": problems, "notes": notes,
            "model": {**asdict(arch), "params": mem.total_params(arch), "active_params": mem.active_params(arch),
                      "source": arch_src},
            "cluster": asdict(cluster), "placement": placement,
            "sequence_tokens": r.engines.max_model_len, "micro_batch_size": cfg.train.rows_per_micro_batch,
            "max_tokens_per_micro_batch": cfg.train.max_tokens_per_micro_batch,
            "recompute": cfg.train.recompute, "offload_idle": cfg.train.offload_idle,
            "per_gpu_bytes": per_gpu_bytes(trainer, engine), "trainer": trainer, "engine": engine,
            "weight_transfer": transfer_formula(cfg, arch) if transfer_buffers(cfg, arch) else "",
            "lora": lora_part(cfg, arch),
            "assumptions": ASSUMPTIONS}


def lora_part(cfg: RootConfig, arch: Arch) -> dict | None:
    """LoRA's figures for the whole model (the per-GPU ones are the trainer's): the adapters'
    elements and bytes, what one push carries (weight_sync.lora) against the full model. None
    without LoRA."""
    lora = plan_lora.lora_of(cfg)
    if not lora:
        return None
    wb = mem.DTYPE_BYTES[cfg.model.dtype]
    n = plan_lora.adapter_params(arch, lora.rank, lora.targets)
    return {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets), "adapter_params": n,
            "adapter_bytes": n * wb, "model_bytes": mem.total_params(arch) * wb,
            "push": plan_lora.push_mode(cfg), "push_bytes": push_bytes(cfg, arch),
            "reference": cfg.algo.uses_reference}   # a KL term: the reference is the actor, adapters off


def check_placeable(cfg: RootConfig, arch: Arch, cluster: ClusterConfig) -> None:
    """What no plan can place: a CPU-only cluster, a TP x PP or an engine TP the model (or
    vLLM, or one node) does not allow, a LoRA adapters push on a wire that cannot carry it.
    Raises ConfigError."""
    g = cluster.gpus_per_node
    if g == 0:
        raise ConfigError("cluster.gpus_per_node=0 (a CPU-only recipe): nothing to place; give "
                          "--gpus-per-node and --nodes, or a recipe with a cluster: block")
    check_layout(arch, cfg.parallel.tp, cfg.parallel.pp, *expert_layout(cfg), cfg.parallel.sequence_parallel)
    plan_lora.check_push_route(cfg, plan_backend(cfg))   # an adapters push: the gloo wire only
    etp = cfg.rollout.engines.tp
    if arch.heads % etp or (arch.kv_heads % etp and etp % arch.kv_heads):
        raise ConfigError(f"rollout.engines.tp={etp}: vLLM needs it to divide the {arch.heads} heads, and to divide "
                          f"or be a multiple of the {arch.kv_heads} KV heads")
    if etp > g:
        raise ConfigError(f"rollout.engines.tp={etp} > cluster.gpus_per_node={g}: an engine's TP group must "
                          f"sit on one node")


def trainer_part(cfg: RootConfig, arch: Arch, cluster: ClusterConfig, rm_arch: Arch | None,
                 notes: list[str], trainer_gpus: int) -> tuple[dict | None, int | None, list[dict]]:
    """(the trainer's memory on its worst stage, DP, problems) on `trainer_gpus` GPUs; no memory
    and no DP when TP x PP does not divide them. Adds to `notes`."""
    g, tp, pp = cluster.gpus_per_node, cfg.parallel.tp, cfg.parallel.pp
    usable = (cluster.gpu_mem_gb - cluster.reserve_gb) * GiB
    if trainer_gpus < tp * pp or trainer_gpus % (tp * pp):
        return None, None, [indivisible_problem(cfg, arch, cluster, rm_arch, usable, trainer_gpus)]
    lay = layout_of(cfg, tp, pp, trainer_gpus // (tp * pp))
    if check_expert_world(arch, lay):   # before validate_world: a problem with its fixes, not a bare error
        return None, lay.dp, [indivisible_problem(cfg, arch, cluster, rm_arch, usable, trainer_gpus,
                                                  check_expert_world(arch, lay))]
    dp = validate_world(cfg, trainer_gpus)
    trainer = trainer_memory(cfg, arch, lay, FUSED, rm_arch)
    trainer["usable_bytes"] = usable
    trainer["fits"] = trainer["peak_bytes"] <= usable
    if tp > g:
        notes.append(f"parallel.tp={tp} spans nodes (gpus_per_node={g}): TP all-reduces go over the network")
    if trainer["fits"]:
        return trainer, dp, []
    held = trainer["roles"]["weight_transfer"]
    return trainer, dp, [{"role": "trainer", "what": f"stage {trainer['stage']} at '{trainer['phase']}' needs "
                          f"{gib(trainer['peak_bytes'])} GiB per GPU, {gib(usable)} GiB usable"
                          + (f" (of it {gib(held)} GiB weight transfer buffers on global rank 0: "
                             f"{transfer_formula(cfg, arch)})" if held else ""),
                          "short_gib": gib(trainer["peak_bytes"] - usable),
                          "fix": trainer_fixes(cfg, arch, lay, trainer_gpus, g, FUSED, rm_arch, usable)}]


def indivisible_problem(cfg: RootConfig, arch: Arch, cluster: ClusterConfig, rm_arch: Arch | None,
                        usable: float, trainer_gpus: int, experts_why: str = "") -> dict:
    """One model copy (TP x PP GPUs) does not divide the trainer's GPUs, or (`experts_why`) the
    expert groups (EP x expert TP) do not divide a stage's: the node count that would do, and
    the lightest layout of the GPUs there are."""
    g, tp, pp = cluster.gpus_per_node, cfg.parallel.tp, cfg.parallel.pp
    trainer_nodes = cluster.trainer_node_count
    best = best_layout(cfg, arch, trainer_gpus, g, FUSED, rm_arch) if trainer_gpus else None
    ep, etp = expert_layout(cfg)
    group = tp * pp * (ep * etp // math.gcd(ep * etp, tp) if experts_why else 1)  # GPUs of one copy (of the experts)
    need = group // math.gcd(group, g)   # fewest whole nodes holding a multiple of such groups
    fix = (f"TP={tp} x PP={pp}" + (f" with EP={ep} x expert TP={etp}" if experts_why else "")
           + f" needs a multiple of {need} trainer nodes ({need + cluster.engine_nodes} nodes with the engines)")
    if best:
        lay, peak = best
        fits = peak <= usable
        fix += (f"; on {trainer_gpus} GPUs the lightest layout is {layout_setting(lay, arch)} "
                f"(dp={lay.dp}), {gib(peak)} GiB per GPU, which "
                + ("fits" if fits else f"does not fit either ({gib(peak - usable)} GiB over)"))
    where = f"{trainer_nodes} nodes x {g}" if trainer_gpus == trainer_nodes * g else \
        f"those of its {g} the engines leave on the node"   # one node's split (plan/node_split.py)
    what = experts_why or (f"one model copy needs TP x PP = {tp * pp} GPUs, which does not "
                           f"divide the trainer's {trainer_gpus} ({where})")
    return {"role": "trainer", "what": what,
            "short_gib": None, "fix": fix}   # the GiB are in the fix: they are the best layout's


def engine_part(cfg: RootConfig, arch: Arch, cluster: ClusterConfig, engine_gpus: int) -> tuple[dict, list[dict]]:
    """(the engines' memory per GPU, problems) on `engine_gpus` GPUs: too few engine GPUs, an
    engine GPU over its vLLM share, transfer buffers that do not fit outside it."""
    r, g = cfg.rollout, cluster.gpus_per_node
    engines, etp = r.engines.pool_size, r.engines.tp
    problems = []
    if r.engines.mode != "remote" and engines * etp > engine_gpus:
        problems.append({"role": "engines", "what": f"{engines} engines x TP {etp} = {engines * etp} GPUs, "
                         f"the engine pool has {engine_gpus} ({cluster.engine_nodes} nodes x {g})",
                         "short_gib": None,
                         "fix": f"lower rollout.engines.count to {engine_gpus // etp} or give "
                                f"cluster.engine_nodes={math.ceil(engines * etp / g)}"})
    e = engine_memory(cfg, arch, cluster, engines, etp)
    if e["need_bytes"] > e["budget_bytes"]:
        kv_room = e["budget_bytes"] - e["per_gpu_bytes"]["weights"] - e["per_gpu_bytes"]["workspace"] \
            - e["per_gpu_bytes"]["lora"]
        max_req = max(0, int(kv_room // (r.engines.max_model_len * e["kv_bytes_per_token_per_gpu"]))) * engines
        problems.append({"role": "engines", "what": f"an engine GPU needs {gib(e['need_bytes'])} GiB "
                         f"(weights {gib(e['per_gpu_bytes']['weights'])}, KV cache for "
                         f"{e['requests_per_engine']} requests x {r.engines.max_model_len} tokens "
                         f"{gib(e['per_gpu_bytes']['kv_cache'])}), its budget is {gib(e['budget_bytes'])} GiB "
                         f"(rollout.engines.gpu_memory_utilization={r.engines.gpu_memory_utilization})",
                         "short_gib": gib(e["need_bytes"] - e["budget_bytes"]),
                         "fix": f"raise rollout.engines.gpu_memory_utilization "
                                f"(<= {1 - cluster.reserve_gb / cluster.gpu_mem_gb:.2f}), a larger rollout.engines.tp, "
                                f"more engines, or rollout.partial.concurrency <= {max_req}"})
    if e["transfer_bytes"] > e["transfer_room_bytes"]:
        problems.append(transfer_room_problem(cfg, arch, cluster, e))
    if e["staging_bytes"] and not e["staging_fits"]:
        e["staging_warning"] = staging_warning(cfg, e)
    return e, problems


def staging_warning(cfg: RootConfig, e: dict) -> str:
    """One line for an engine GPU that fits its weights, KV cache and workspace but not a staged
    update's staging area beside them (weight_sync.staged on a GPU wire), naming the fix."""
    return (f"weight_sync.staged=true: an engine GPU would need {gib(e['need_bytes'] + e['staging_bytes'])} GiB with "
            f"the staging area of {gib(e['staging_bytes'])} GiB (the next version of its weights), its budget is "
            f"{gib(e['budget_bytes'])} GiB (rollout.engines.gpu_memory_utilization="
            f"{cfg.rollout.engines.gpu_memory_utilization}): DOES NOT FIT staged; "
            f"to fix: weight_sync.staged=false (the engines pause for the whole push), "
            f"a larger rollout.engines.tp or a lower rollout.partial.concurrency")


def transfer_room_problem(cfg: RootConfig, arch: Arch, cluster: ClusterConfig, e: dict) -> dict:
    """An engine GPU's transfer buffers do not fit outside vLLM's share, less the reserve."""
    room, util = e["transfer_room_bytes"], cfg.rollout.engines.gpu_memory_utilization
    # the largest share that leaves the buffers room, rounded down to the 2 decimals printed;
    # offered only while the weights, KV cache and workspace still fit in it
    lower = math.floor((cluster.gpu_mem_gb - cluster.reserve_gb - e["transfer_bytes"] / GiB)
                       / cluster.gpu_mem_gb * 100) / 100
    lower = lower if lower * cluster.gpu_mem_gb * GiB >= e["need_bytes"] else 0
    return {"role": "engines", "what": f"an engine GPU receives weights into "
            f"{gib(e['transfer_bytes'])} GiB of transfer buffers ({transfer_formula(cfg, arch)}) "
            f"outside vLLM's share (rollout.engines.gpu_memory_utilization={util}), where "
            f"{gib(max(room, 0))} GiB are left after the {cluster.reserve_gb} GiB reserve",
            "short_gib": gib(e["transfer_bytes"] - room),
            "fix": "lower weight_sync.bucket_mb or weight_sync.num_buffers"
                   + (f", or rollout.engines.gpu_memory_utilization <= {lower:.2f}" if lower > 0 else "")}


def per_gpu_bytes(trainer: dict | None, engine: dict | None) -> dict:
    """The plan's bytes per GPU by role, trainer and engine GPUs in one dict."""
    per_gpu = {}
    if trainer:
        for role in ("actor", "critic"):
            per_gpu[role] = sum(trainer["roles"][role].values())
        for role in ("reference", "reward", "routes", "activations"):
            per_gpu[role] = trainer["roles"][role]
        per_gpu["weight_transfer"] = trainer["sender_bytes"]   # global rank 0's GPU only
    if engine:
        per_gpu["engine_weights"] = engine["per_gpu_bytes"]["weights"]
        per_gpu["kv_cache"] = engine["per_gpu_bytes"]["kv_cache"]
        per_gpu["engine_workspace"] = engine["per_gpu_bytes"]["workspace"]
        if engine["per_gpu_bytes"]["lora"]:
            per_gpu["engine_lora"] = engine["per_gpu_bytes"]["lora"]
        per_gpu["engine_staging"] = engine["staging_bytes"]
        per_gpu["engine_weight_transfer"] = engine["transfer_bytes"]
    return per_gpu
