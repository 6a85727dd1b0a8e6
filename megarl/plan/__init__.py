"""`megarl plan RECIPE`: where every model goes on the recipe's cluster and whether it fits.

Placement follows the code: trainer ranks (TP x PP x DP) each hold actor, reference, critic
(PPO) and reward model (reward.model_path) for their stage and TP rank; the vLLM engines are
their own GPU pool (cluster.engine_nodes), rollout.engines of rollout.engine_tp GPUs.
train.offload_idle keeps reference, critic weights+gradients and reward model in host memory
except in the phases that use them (models/offload.py; the critic's Adam state stays).
weight_sync.transport=collective adds the weight transfer's packed GPU buffers on the sending
trainer GPU (global rank 0: PP stage 0) and on every engine GPU. The memory formulas are in
`megarl/plan/memory.py`; docs/plan.md compares them with published figures.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace

from megarl.config.schema import ClusterConfig, ConfigError, RootConfig, validate_world
from megarl.plan import memory as mem
from megarl.plan.memory import GiB, Arch


# -- inputs ----------------------------------------------------------------------------------
def arch_from_hf(d: dict) -> Arch:
    heads = d["num_attention_heads"]
    return Arch(hidden=d["hidden_size"], layers=d["num_hidden_layers"], heads=heads,
                kv_heads=d.get("num_key_value_heads") or heads,
                head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                ffn=d["intermediate_size"], vocab=d["vocab_size"],
                max_positions=d.get("max_position_embeddings", 0),
                tied=bool(d.get("tie_word_embeddings", False)),
                qkv_bias="Qwen2" in (d.get("architectures") or [""])[0])


def resolve_arch(cfg: RootConfig) -> tuple[Arch, str]:
    """model.arch from the recipe, else model.path/config.json."""
    f = cfg.model.arch
    if f.given:
        return Arch(f.hidden_size, f.num_layers, f.num_heads, f.num_kv_heads,
                    f.head_dim or f.hidden_size // f.num_heads, f.ffn_hidden_size, f.vocab_size,
                    f.max_position_embeddings, f.tie_embeddings, f.qkv_bias), "model.arch (recipe)"
    path = os.path.join(cfg.model.path, "config.json")
    try:
        with open(path) as fh:
            return arch_from_hf(json.load(fh)), path
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"model.arch is not set and {path} is not readable ({err.__class__.__name__}): "
                          f"give the architecture in the recipe (see recipes/models/*.yaml)") from None


def reward_arch(cfg: RootConfig, policy: Arch) -> tuple[Arch | None, str]:
    if not cfg.reward.model_path:
        return None, ""
    path = os.path.join(cfg.reward.model_path, "config.json")
    try:
        with open(path) as fh:
            return replace(arch_from_hf(json.load(fh)), tied=True), path
    except (OSError, ValueError, KeyError):
        return policy, "assumed the policy's architecture (reward.model_path/config.json not readable here)"


def resolve_cluster(cfg: RootConfig, nodes: int | None = None, gpus_per_node: int | None = None,
                    gpu_mem_gb: float | None = None) -> tuple[ClusterConfig, list[str]]:
    """The recipe's cluster with command-line changes. A different node count keeps the
    recipe's trainer : engine split in proportion (whole nodes, at least one each)."""
    c, notes = cfg.cluster, []
    for key, v, least in (("--nodes", nodes, 1), ("--gpus-per-node", gpus_per_node, 0)):
        if v is not None and v < least:
            raise ConfigError(f"{key}={v}: must be >= {least}")
    if gpu_mem_gb is not None and gpu_mem_gb <= 0:
        raise ConfigError(f"--gpu-mem-gb={gpu_mem_gb}: must be > 0 (GiB per GPU)")
    kw = {}
    if gpus_per_node is not None:
        kw["gpus_per_node"] = gpus_per_node
    if gpu_mem_gb is not None:
        kw["gpu_mem_gb"] = gpu_mem_gb
    if nodes is not None and nodes != c.nodes:
        kw["nodes"] = nodes
        if c.engine_nodes:
            eng = max(1, round(c.engine_nodes * nodes / c.nodes))
            if eng >= nodes:
                raise ConfigError(f"--nodes={nodes}: the engines and the trainer each need whole nodes "
                                  f"(the recipe gives the engines {c.engine_nodes} of {c.nodes}); "
                                  f"give at least 2 nodes")
            kw["engine_nodes"], kw["trainer_nodes"] = eng, nodes - eng
            notes.append(f"--nodes={nodes}: split as in the recipe ({c.trainer_node_count}:{c.engine_nodes}) "
                         f"-> trainer {nodes - eng}, engines {eng} nodes")
        elif c.trainer_nodes:
            kw["trainer_nodes"] = nodes
    # a new ClusterConfig re-runs the schema's checks on the changed values
    return ClusterConfig(**{**asdict(c), **kw}), notes


# -- weight transfer ---------------------------------------------------------------------------
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
            f"+ largest tensor {_gib(big)} GiB)")


def staging_note(cfg: RootConfig, arch: Arch) -> str:
    """What a sync over files needs on disk (not on a GPU): the whole model as safetensors,
    written by the trainer and read by every engine, every step."""
    ws = cfg.weight_sync
    size = mem.total_params(arch) * mem.DTYPE_BYTES[cfg.model.dtype]
    if ws.transport == "files":
        return (f"weight_sync.transport=files: every sync stages the whole model, {_gib(size)} GiB, as files under "
                f"weight_sync.staging_dir={ws.staging_dir} (host memory for /dev/shm, else disk), which every engine "
                f"must reach (a shared file system on a cluster) and reads in full; no GPU transfer buffers")
    if ws.resolved_backend(cuda=True) == "gloo":
        return (f"weight_sync.backend=gloo: the transfer's buffers ({transfer_formula(cfg, arch)}) are host memory "
                f"on global rank 0 and on every engine worker, not counted on the GPUs")
    return ""


# -- trainer ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int


def check_layout(arch: Arch, tp: int, pp: int) -> None:
    """What models/config.py refuses at build time, said before any GPU is allocated."""
    if arch.kv_heads % tp or arch.heads % tp:
        raise ConfigError(f"parallel.tp={tp} must divide the model's {arch.heads} heads and {arch.kv_heads} "
                          f"KV heads (QKV is split by whole GQA groups): use one of "
                          f"{[d for d in range(1, arch.kv_heads + 1) if arch.kv_heads % d == 0 and arch.heads % d == 0]}")
    if arch.layers % pp:
        raise ConfigError(f"parallel.pp={pp} must divide the model's {arch.layers} layers: use one of "
                          f"{[d for d in range(1, arch.layers + 1) if arch.layers % d == 0 and d <= 16]}")


def trainer_memory(cfg: RootConfig, arch: Arch, lay: Layout, fused: bool = True, rm_arch: Arch | None = None) -> dict:
    """Peak bytes per trainer GPU over its phases, on the worst PP stage, by role.
    fused: the GPU path (Transformer Engine, fused SwiGLU); False: megatron's local spec (CPU).
    On the GPU path stage 0 also holds the weight transfer's buffers (`transfer_buffers`): its
    first GPU is global rank 0, the sender. They are counted in every phase, a safe bound
    (memory.transfer_buffer_bytes says why). The CPU path has none."""
    t, tp, pp, dp = cfg.train, lay.tp, lay.pp, lay.dp
    sender = transfer_buffers(cfg, arch) if fused else 0
    div, wb = cfg.model.make_vocab_size_divisible_by, mem.DTYPE_BYTES[cfg.model.dtype]
    seq, mbs = cfg.rollout.max_model_len, t.micro_batch_size
    micro = max(1, cfg.samples_per_step // t.mini_batches // dp // mbs)
    per_param = mem.trainable_bytes_per_param(cfg.model.dtype, dp)
    ppo = cfg.algo.name == "ppo"
    sp = cfg.parallel.sequence_parallel
    worst = None
    for stage in range(pp):
        def trainable(role):
            n = mem.stage_params(arch, tp, pp, stage, role, div)
            return {k: n * b for k, b in per_param.items()}
        actor = trainable("actor")
        critic = trainable("critic") if ppo else {"weights": 0, "grads": 0, "optimizer": 0}
        ref = mem.stage_params(arch, tp, pp, stage, "reference", div) * wb
        rm = mem.stage_params(rm_arch, tp, pp, stage, "reward", div) * wb if rm_arch else 0
        act = dict(seq=seq, mbs=mbs, tp=tp, pp=pp, stage=stage, act_bytes=wb, sequence_parallel=sp,
                   fused=fused, divisible_by=div)
        train_actor = mem.stage_activation_bytes(arch, microbatches=micro, recompute=t.recompute, **act)
        train_critic = mem.stage_activation_bytes(arch, microbatches=micro, recompute=t.recompute,
                                                  with_logits=False, **act)
        fwd = mem.forward_only_bytes(arch, **act)
        fwd_value = mem.forward_only_bytes(arch, with_logits=False, **act)
        a, c_model, c_opt = sum(actor.values()), critic["weights"] + critic["grads"], critic["optimizer"]
        transfer = sender if stage == 0 else 0
        # phase -> (models resident besides the base, activations of the phase)
        if t.offload_idle:   # always resident: actor + the critic's Adam state (offload.py frees weights+grads only)
            base = a + c_opt + transfer
            phases = {"old logprobs (actor forward)": (0, fwd), "reference logprobs": (ref, fwd),
                      "actor update": (0, train_actor)}
            if ppo:
                phases["values (critic forward)"] = (c_model, fwd_value)
                phases["critic update"] = (c_model, train_critic)
            if rm:
                phases["reward model"] = (rm, fwd_value)
        else:
            base = a + c_model + c_opt + ref + rm + transfer
            phases = {"old logprobs (actor forward)": (0, fwd), "actor update": (0, train_actor)}
            if ppo:
                phases["critic update"] = (0, train_critic)
        totals = {k: base + extra + acts for k, (extra, acts) in phases.items()}
        phase = max(totals, key=totals.get)
        res = {"stage": stage, "phase": phase, "peak_bytes": totals[phase], "phases": totals,
               "roles": {"actor": actor, "critic": critic, "reference": ref, "reward": rm,
                         "weight_transfer": transfer, "activations": phases[phase][1]},
               "microbatches": micro, "in_flight": mem.in_flight_microbatches(pp, stage, micro)}
        if stage == 0:
            sender_peak = totals[phase]
        if worst is None or res["peak_bytes"] > worst["peak_bytes"]:
            worst = res
    # the sender's buffers and its GPU's peak, also when another stage is the worst
    worst.update(sender_bytes=sender, sender_peak_bytes=sender_peak)
    return worst


def candidate_layouts(arch: Arch, gpus: int, gpus_per_node: int):
    """Every TP x PP x DP the code accepts on `gpus` GPUs, TP within a node."""
    for tp in range(1, min(gpus_per_node, arch.kv_heads) + 1):
        if arch.kv_heads % tp or arch.heads % tp:
            continue
        for pp in range(1, arch.layers + 1):
            if arch.layers % pp == 0 and gpus % (tp * pp) == 0:
                yield Layout(tp, pp, gpus // (tp * pp))


def best_layout(cfg, arch, gpus, gpus_per_node, fused, rm_arch) -> tuple[Layout, float] | None:
    """The layout of `gpus` GPUs with the lowest peak (ties: least PP, then least TP)."""
    best = None
    for lay in candidate_layouts(arch, gpus, gpus_per_node):
        try:
            validate_world(replace(cfg, parallel=replace(cfg.parallel, tp=lay.tp, pp=lay.pp)), gpus)
        except ConfigError:
            continue
        peak = trainer_memory(cfg, arch, lay, fused, rm_arch)["peak_bytes"]
        key = (peak, lay.pp, lay.tp)
        if best is None or key < best[0]:
            best = (key, lay)
    return (best[1], best[0][0]) if best else None


# -- engines ---------------------------------------------------------------------------------
def engine_memory(cfg: RootConfig, arch: Arch, cluster: ClusterConfig, engines: int, engine_tp: int) -> dict:
    """Bytes per engine GPU. vLLM fills its share (rollout.gpu_memory_utilization) with weights,
    workspace and KV cache when it starts; the weight transfer's buffers are allocated later,
    at each sync, so they must fit in what vLLM leaves outside its share, less the reserve."""
    r = cfg.rollout
    # sync mode submits every sample of the step at once; partial keeps `concurrency` in flight
    in_flight = cfg.samples_per_step if r.mode == "sync" else r.concurrency
    per_engine = math.ceil(in_flight / engines)
    kv_tok = mem.kv_bytes_per_token(arch, engine_tp)
    b = {"weights": mem.engine_weight_bytes(arch, engine_tp),
         "kv_cache": per_engine * r.max_model_len * kv_tok,
         "workspace": mem.engine_workspace_bytes(arch, engine_tp, per_engine)}
    total = cluster.gpu_mem_gb * GiB
    budget = min(r.gpu_memory_utilization * total, total - cluster.reserve_gb * GiB)
    transfer = transfer_buffers(cfg, arch)
    room = total - r.gpu_memory_utilization * total - cluster.reserve_gb * GiB
    transfer_fits = not transfer or transfer <= room
    return {"per_gpu_bytes": b, "need_bytes": sum(b.values()), "budget_bytes": budget,
            "requests_per_engine": per_engine, "kv_bytes_per_token_per_gpu": kv_tok,
            "transfer_bytes": transfer, "transfer_room_bytes": room,
            "fits": sum(b.values()) <= budget and transfer_fits}


# -- the plan ----------------------------------------------------------------------------------
def _gib(x: float) -> float:
    return round(x / GiB, 2)


def make_plan(cfg: RootConfig, nodes: int | None = None, gpus_per_node: int | None = None,
              gpu_mem_gb: float | None = None) -> dict:
    """Placement and memory per GPU; raises ConfigError for a layout the code would refuse."""
    arch, arch_src = resolve_arch(cfg)
    rm_arch, rm_note = reward_arch(cfg, arch)
    cluster, notes = resolve_cluster(cfg, nodes, gpus_per_node, gpu_mem_gb)
    if rm_note and rm_arch is arch:
        notes.append(f"reward model: {rm_note}")
    g = cluster.gpus_per_node
    if g == 0:
        raise ConfigError("cluster.gpus_per_node=0 (a CPU-only recipe): nothing to place; give "
                          "--gpus-per-node and --nodes, or a recipe with a cluster: block")
    fused = True   # GPU runs: Transformer Engine (fused norm + linear, flash attention), fused SwiGLU
    usable = (cluster.gpu_mem_gb - cluster.reserve_gb) * GiB
    check_layout(arch, cfg.parallel.tp, cfg.parallel.pp)
    r = cfg.rollout
    engines, etp = r.engine_count, r.engine_tp
    if arch.heads % etp or (arch.kv_heads % etp and etp % arch.kv_heads):
        raise ConfigError(f"rollout.engine_tp={etp}: vLLM needs it to divide the {arch.heads} heads, and to divide "
                          f"or be a multiple of the {arch.kv_heads} KV heads")
    if etp > g:
        raise ConfigError(f"rollout.engine_tp={etp} > cluster.gpus_per_node={g}: an engine's TP group must "
                          f"sit on one node")
    trainer_nodes = cluster.trainer_node_count
    trainer_gpus = trainer_nodes * g
    engine_gpus = cluster.engine_nodes * g
    if r.engine_mode != "remote" and not cluster.engine_nodes:
        notes.append("cluster.engine_nodes=0: engines not placed on this cluster (rollout.engine_mode "
                     f"{r.engine_mode}); only the trainer is checked")
    problems = []
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    placement = {"trainer": {"nodes": trainer_nodes, "gpus": trainer_gpus, "tp": tp, "pp": pp, "dp": None},
                 "engines": {"nodes": cluster.engine_nodes, "gpus": engine_gpus, "count": engines,
                             "tp": etp, "gpus_used": engines * etp}}
    trainer = None
    if trainer_gpus < tp * pp or trainer_gpus % (tp * pp):
        best = best_layout(cfg, arch, trainer_gpus, g, fused, rm_arch) if trainer_gpus else None
        need = tp * pp // math.gcd(tp * pp, g)   # fewest whole nodes holding a multiple of TP x PP GPUs
        fix = (f"TP={tp} x PP={pp} needs a multiple of {need} trainer nodes "
               f"({need + cluster.engine_nodes} nodes with the engines)")
        if best:
            lay, peak = best
            fits = peak <= usable
            fix += (f"; on {trainer_gpus} GPUs the lightest layout is parallel.tp={lay.tp} parallel.pp={lay.pp} "
                    f"(dp={lay.dp}), {_gib(peak)} GiB per GPU, which "
                    + ("fits" if fits else f"does not fit either ({_gib(peak - usable)} GiB over)"))
        problems.append({"role": "trainer", "what": f"one model copy needs TP x PP = {tp * pp} GPUs, which does not "
                         f"divide the trainer's {trainer_gpus} ({trainer_nodes} nodes x {g})",
                         "short_gib": None, "fix": fix})   # the GiB are in the fix: they are the best layout's
    else:
        dp = validate_world(cfg, trainer_gpus)
        placement["trainer"]["dp"] = dp
        lay = Layout(tp, pp, dp)
        trainer = trainer_memory(cfg, arch, lay, fused, rm_arch)
        trainer["usable_bytes"] = usable
        trainer["fits"] = trainer["peak_bytes"] <= usable
        if tp > g:
            notes.append(f"parallel.tp={tp} spans nodes (gpus_per_node={g}): TP all-reduces go over the network")
        if not trainer["fits"]:
            held = trainer["roles"]["weight_transfer"]
            problems.append({"role": "trainer", "what": f"stage {trainer['stage']} at '{trainer['phase']}' needs "
                             f"{_gib(trainer['peak_bytes'])} GiB per GPU, {_gib(usable)} GiB usable"
                             + (f" (of it {_gib(held)} GiB weight transfer buffers on global rank 0: "
                                f"{transfer_formula(cfg, arch)})" if held else ""),
                             "short_gib": _gib(trainer["peak_bytes"] - usable),
                             "fix": trainer_fixes(cfg, arch, lay, trainer_gpus, g, fused, rm_arch, usable)})
    engine = None
    if cluster.engine_nodes or r.engine_mode == "remote":
        if r.engine_mode != "remote" and engines * etp > engine_gpus:
            problems.append({"role": "engines", "what": f"{engines} engines x TP {etp} = {engines * etp} GPUs, "
                             f"the engine pool has {engine_gpus} ({cluster.engine_nodes} nodes x {g})",
                             "short_gib": None,
                             "fix": f"lower rollout.engines to {engine_gpus // etp} or give "
                                    f"cluster.engine_nodes={math.ceil(engines * etp / g)}"})
        engine = engine_memory(cfg, arch, cluster, engines, etp)
        e = engine
        if e["need_bytes"] > e["budget_bytes"]:
            kv_room = e["budget_bytes"] - e["per_gpu_bytes"]["weights"] - e["per_gpu_bytes"]["workspace"]
            max_req = max(0, int(kv_room // (r.max_model_len * e["kv_bytes_per_token_per_gpu"]))) * engines
            problems.append({"role": "engines", "what": f"an engine GPU needs {_gib(e['need_bytes'])} GiB "
                             f"(weights {_gib(e['per_gpu_bytes']['weights'])}, KV cache for "
                             f"{e['requests_per_engine']} requests x {r.max_model_len} tokens "
                             f"{_gib(e['per_gpu_bytes']['kv_cache'])}), its budget is {_gib(e['budget_bytes'])} GiB "
                             f"(rollout.gpu_memory_utilization={r.gpu_memory_utilization})",
                             "short_gib": _gib(e["need_bytes"] - e["budget_bytes"]),
                             "fix": f"raise rollout.gpu_memory_utilization (<= {1 - cluster.reserve_gb / cluster.gpu_mem_gb:.2f}), "
                                    f"a larger rollout.engine_tp, more engines, or rollout.concurrency <= {max_req}"})
        if e["transfer_bytes"] > e["transfer_room_bytes"]:
            room, util = e["transfer_room_bytes"], r.gpu_memory_utilization
            # the largest share that leaves the buffers room, rounded down to the 2 decimals printed;
            # offered only while the weights, KV cache and workspace still fit in it
            lower = math.floor((cluster.gpu_mem_gb - cluster.reserve_gb - e["transfer_bytes"] / GiB)
                               / cluster.gpu_mem_gb * 100) / 100
            lower = lower if lower * cluster.gpu_mem_gb * GiB >= e["need_bytes"] else 0
            problems.append({"role": "engines", "what": f"an engine GPU receives weights into "
                             f"{_gib(e['transfer_bytes'])} GiB of transfer buffers ({transfer_formula(cfg, arch)}) "
                             f"outside vLLM's share (rollout.gpu_memory_utilization={util}), where "
                             f"{_gib(max(room, 0))} GiB are left after the {cluster.reserve_gb} GiB reserve",
                             "short_gib": _gib(e["transfer_bytes"] - room),
                             "fix": "lower weight_sync.bucket_mb or weight_sync.num_buffers"
                                    + (f", or rollout.gpu_memory_utilization <= {lower:.2f}" if lower > 0 else "")})
    per_gpu = {}
    if trainer:
        for role in ("actor", "critic"):
            per_gpu[role] = sum(trainer["roles"][role].values())
        for role in ("reference", "reward", "activations"):
            per_gpu[role] = trainer["roles"][role]
        per_gpu["weight_transfer"] = trainer["sender_bytes"]   # global rank 0's GPU only
    if engine:
        per_gpu["engine_weights"] = engine["per_gpu_bytes"]["weights"]
        per_gpu["kv_cache"] = engine["per_gpu_bytes"]["kv_cache"]
        per_gpu["engine_workspace"] = engine["per_gpu_bytes"]["workspace"]
        per_gpu["engine_weight_transfer"] = engine["transfer_bytes"]
    note = staging_note(cfg, arch)
    if note:
        notes.append(note)
    return {"fits": not problems, "problems": problems, "notes": notes,
            "model": {**asdict(arch), "params": mem.total_params(arch), "source": arch_src},
            "cluster": asdict(cluster), "placement": placement,
            "sequence_tokens": r.max_model_len, "micro_batch_size": cfg.train.micro_batch_size,
            "recompute": cfg.train.recompute, "offload_idle": cfg.train.offload_idle,
            "per_gpu_bytes": per_gpu, "trainer": trainer, "engine": engine,
            "weight_transfer": transfer_formula(cfg, arch) if transfer_buffers(cfg, arch) else "",
            "assumptions": ASSUMPTIONS}


ASSUMPTIONS = [
    "trainer: megatron DDP + distributed optimizer as models/builders.py builds it: weights (dtype), "
    "fp32 gradient buffer, Adam state (+ fp32 main weights for bf16) sharded over DP",
    "activations: Korthikanti et al. 2022 per layer (RMSNorm/SwiGLU/GQA, no dropout, TE fused kernels + flash attention), "
    "1F1B in-flight micro-batches, sequence = rollout.max_model_len (prompt + response bound)",
    "engine: bf16 weights / engine TP + KV cache 2 x layers x kv_heads x head_dim x 2 bytes per token "
    "for every in-flight request at rollout.max_model_len, within rollout.gpu_memory_utilization",
    "reserve per GPU (cluster.reserve_gb): CUDA context, NCCL buffers, allocator fragmentation",
    "weight_sync.transport=collective (nccl): weight_sync.num_buffers packed buffers of up to weight_sync.bucket_mb "
    "+ the largest tensor on global rank 0's GPU (in every phase: a safe bound) and on every engine GPU "
    "(outside vLLM's gpu_memory_utilization share, less the reserve)",
]


def trainer_fixes(cfg, arch, lay, gpus, gpn, fused, rm_arch, usable) -> str:
    """Concrete changes with the peak each gives (same formulas), the fitting ones first."""
    t, opts = cfg.train, []

    def peak(c, layout):
        return trainer_memory(c, arch, layout, fused, rm_arch)["peak_bytes"]

    if not t.offload_idle:
        opts.append(("train.offload_idle=true", peak(replace(cfg, train=replace(t, offload_idle=True)), lay)))
    if t.recompute == "none":
        opts.append(("train.recompute=full", peak(replace(cfg, train=replace(t, recompute="full")), lay)))
    if t.micro_batch_size > 1:
        opts.append(("train.micro_batch_size=1", peak(replace(cfg, train=replace(t, micro_batch_size=1)), lay)))
    best = best_layout(cfg, arch, gpus, gpn, fused, rm_arch)
    if best and (best[0].tp, best[0].pp) != (lay.tp, lay.pp):
        opts.append((f"parallel.tp={best[0].tp} parallel.pp={best[0].pp}", best[1]))
    ws = cfg.weight_sync
    if transfer_buffers(cfg, arch):   # only global rank 0 holds them, but it may be the one that does not fit
        def sync(**kw):
            return peak(replace(cfg, weight_sync=replace(ws, **kw)), lay)
        if ws.num_buffers > 1:
            opts.append(("weight_sync.num_buffers=1 (no overlap of gather and send)", sync(num_buffers=1)))
        if ws.bucket_mb > 128:
            opts.append(("weight_sync.bucket_mb=128", sync(bucket_mb=128)))
        opts.append(("weight_sync.transport=files (staged on disk, slower)", sync(transport="files")))
    more = Layout(lay.tp, lay.pp, lay.dp * 2)
    opts.append((f"twice the trainer nodes (dp={more.dp}: Adam state sharded twice as thin)", peak(cfg, more)))
    opts.sort(key=lambda o: o[1])
    return "; ".join(f"{name} -> {_gib(p)} GiB" + (" (fits)" if p <= usable else "") for name, p in opts)


# -- output ------------------------------------------------------------------------------------
def format_plan(p: dict) -> str:
    c, pl, m = p["cluster"], p["placement"], p["model"]
    tr, en = pl["trainer"], pl["engines"]
    lines = [f"model: {m['params'] / 1e9:.2f}B params, {m['layers']} layers, hidden {m['hidden']}, "
             f"heads {m['heads']}/{m['kv_heads']} kv, ffn {m['ffn']}, vocab {m['vocab']} (from {m['source']})",
             f"cluster: {c['nodes']} nodes x {c['gpus_per_node']} GPUs x {c['gpu_mem_gb']} GiB {c['gpu']}".rstrip()
             + f", {c['reserve_gb']} GiB reserved per GPU",
             f"trainer: {tr['nodes']} nodes = {tr['gpus']} GPUs, TP={tr['tp']} PP={tr['pp']} DP={tr['dp'] or '-'}",
             f"engines: {en['count']} x TP={en['tp']} = {en['gpus_used']} of {en['gpus']} GPUs on {en['nodes']} nodes",
             f"sequence {p['sequence_tokens']} tokens, micro batch {p['micro_batch_size']}, "
             f"recompute {p['recompute']}, offload_idle {p['offload_idle']}"]
    t = p["trainer"]
    if t:
        lines.append(f"trainer GPU (worst: PP stage {t['stage']}, {t['in_flight']} of {t['microbatches']} "
                     f"micro-batches in flight), GiB:")
        for role in ("actor", "critic"):
            parts = t["roles"][role]
            if sum(parts.values()):
                lines.append(f"  {role:12s}{_gib(sum(parts.values())):8.2f}  (weights {_gib(parts['weights'])}, "
                             f"grads {_gib(parts['grads'])}, optimizer {_gib(parts['optimizer'])})")
        for role in ("reference", "reward"):
            if t["roles"][role]:
                lines.append(f"  {role:12s}{_gib(t['roles'][role]):8.2f}")
        if t["roles"]["weight_transfer"]:
            lines.append(f"  {'transfer':12s}{_gib(t['roles']['weight_transfer']):8.2f}  (weight transfer buffers, "
                         f"on global rank 0: {p['weight_transfer']})")
        lines.append(f"  {'activations':12s}{_gib(t['roles']['activations']):8.2f}  (at the peak phase)")
        for name, b in t["phases"].items():
            lines.append(f"  phase {name:30s}{_gib(b):8.2f}" + ("  <- peak" if name == t["phase"] else ""))
        lines.append(f"  peak {_gib(t['peak_bytes'])} of {_gib(t['usable_bytes'])} usable: "
                     + ("fits" if t["fits"] else "DOES NOT FIT"))
        if t["sender_bytes"] and t["stage"] != 0:
            lines.append(f"  global rank 0 (PP stage 0) also holds {_gib(t['sender_bytes'])} GiB of weight transfer "
                         f"buffers ({p['weight_transfer']}): peak {_gib(t['sender_peak_bytes'])} GiB")
    e = p["engine"]
    if e:
        b = e["per_gpu_bytes"]
        lines.append(f"engine GPU, GiB: weights {_gib(b['weights'])}, KV cache {_gib(b['kv_cache'])} "
                     f"({e['requests_per_engine']} requests x {p['sequence_tokens']} tokens), workspace "
                     f"{_gib(b['workspace'])}; {_gib(e['need_bytes'])} of {_gib(e['budget_bytes'])} budget: "
                     + ("fits" if e["need_bytes"] <= e["budget_bytes"] else "DOES NOT FIT"))
        if e["transfer_bytes"]:
            lines.append(f"  + weight transfer buffers {_gib(e['transfer_bytes'])} ({p['weight_transfer']}) outside "
                         f"vLLM's share, {_gib(max(e['transfer_room_bytes'], 0))} left there after the reserve: "
                         + ("fits" if e["transfer_bytes"] <= e["transfer_room_bytes"] else "DOES NOT FIT"))
    for n in p["notes"]:
        lines.append(f"note: {n}")
    lines.append("fits" if p["fits"] else "DOES NOT FIT")
    return "\n".join(lines)


def problems_message(p: dict) -> str:
    return "; ".join(f"{x['role']}: {x['what']}" + (f" ({x['short_gib']} GiB short)" if x["short_gib"] else "")
                     + f"; to fix: {x['fix']}" for x in p["problems"])


def check_arch_matches(cfg: RootConfig, hf: dict) -> None:
    """A run whose recipe states model.arch: the facts `megarl plan` sized it with must be
    those of the checkpoint it loads (model.path/config.json), or the plan was for another
    model. Called by models/setup.build_all."""
    if not cfg.model.arch.given:
        return
    ours, theirs = asdict(resolve_arch(cfg)[0]), asdict(arch_from_hf(hf))
    if not hf.get("max_position_embeddings"):
        theirs["max_positions"] = ours["max_positions"]
    wrong = {k: (ours[k], theirs[k]) for k in ours if ours[k] != theirs[k]}
    if wrong:
        raise ConfigError(f"model.arch disagrees with {cfg.model.path}/config.json: "
                          + ", ".join(f"{k} {a} (recipe) != {b}" for k, (a, b) in wrong.items())
                          + ": fix recipes/models/*.yaml or model.path")
