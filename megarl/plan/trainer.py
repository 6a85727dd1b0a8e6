"""The trainer's share of a plan: peak bytes per trainer GPU for a TP x PP x DP layout, the
layouts the code accepts, the lightest of them, and the changes that would make a layout fit."""
from __future__ import annotations

from dataclasses import dataclass, replace

from megarl.config.registry import ADVANTAGES
from megarl.config.schema import ConfigError, RootConfig, validate_world
from megarl.models.arch import Arch
from megarl.plan import experts, routes
from megarl.plan import lora as plan_lora
from megarl.plan import memory as mem
from megarl.plan.memory import gib
from megarl.plan.transfer import transfer_buffers


@dataclass(frozen=True)
class Layout:
    """TP x PP x DP of the trainer's GPUs; an MoE model's experts over EP x ETP within TP x DP
    (experts.expert_data_parallel: EDP = TP x DP / (ETP x EP))."""
    tp: int
    pp: int
    dp: int
    ep: int = 1
    etp: int = 1

    @property
    def edp(self) -> int:
        return experts.expert_data_parallel(self.tp, self.dp, self.ep, self.etp)


def expert_layout(cfg: RootConfig, tp: int | None = None) -> tuple[int, int]:
    """(EP, ETP) of the recipe: parallel.ep, and megatron's default expert TP, = TP (the trainer
    sets no expert_tensor_parallel_size, so the recipe has no expert TP of its own)."""
    return cfg.parallel.ep, cfg.parallel.tp if tp is None else tp


def layout_of(cfg: RootConfig, tp: int, pp: int, dp: int) -> Layout:
    """The recipe's layout with this TP x PP x DP (its EP, its ETP or megatron's default)."""
    return Layout(tp, pp, dp, *expert_layout(cfg, tp))


def check_layout(arch: Arch, tp: int, pp: int, ep: int = 1, etp: int = 1, sequence_parallel: bool = False) -> None:
    """What models/transformer_config.py refuses at build time, said before any GPU is allocated."""
    if arch.kv_heads % tp or arch.heads % tp:
        fits = [d for d in range(1, arch.kv_heads + 1) if arch.kv_heads % d == 0 and arch.heads % d == 0]
        raise ConfigError(f"parallel.tp={tp} must divide the model's {arch.heads} heads and {arch.kv_heads} "
                          f"KV heads (QKV is split by whole GQA groups): use one of {fits}")
    if arch.layers % pp:
        raise ConfigError(f"parallel.pp={pp} must divide the model's {arch.layers} layers: use one of "
                          f"{[d for d in range(1, arch.layers + 1) if arch.layers % d == 0 and d <= 16]}")
    check_expert_layout(arch, tp, ep, etp, sequence_parallel)


def check_expert_layout(arch: Arch, tp: int, ep: int, etp: int, sequence_parallel: bool) -> None:
    """What megatron-core refuses of an expert layout: EP on a dense model, EP not dividing the
    experts (each EP rank holds whole experts), an MoE model trained over TP without sequence
    parallelism (MoELayer.forward raises). EP x ETP dividing TP x DP: `check_expert_world`."""
    if not arch.moe:
        if ep > 1:
            raise ConfigError(f"parallel.ep={ep}: the model has no experts (a dense model): use parallel.ep=1")
        return
    if arch.experts % ep:
        raise ConfigError(f"parallel.ep={ep} must divide the model's {arch.experts} experts (each EP rank holds "
                          f"whole experts): use one of {divisors(arch.experts)}")
    if tp > 1 and not sequence_parallel:
        raise ConfigError(f"parallel.tp={tp} with an MoE model needs parallel.sequence_parallel=true (megatron "
                          f"trains MoE layers over TP only with it), or parallel.tp=1")


def check_expert_world(arch: Arch, lay: Layout) -> str:
    """'' when EP x ETP divides the GPUs of a pipeline stage (TP x DP), as megatron's expert
    groups need; else why not and what would."""
    if (lay.tp * lay.dp) % (lay.ep * lay.etp) == 0:
        return ""
    fits = [e for e in divisors(max(arch.experts, 1)) if (lay.tp * lay.dp) % (e * lay.etp) == 0]
    return (f"parallel.ep={lay.ep} x expert TP {lay.etp} must divide the {lay.tp * lay.dp} GPUs of a pipeline "
            f"stage (TP={lay.tp} x DP={lay.dp}): use parallel.ep in {fits} or more trainer GPUs")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def largest_micro_batch(cfg: RootConfig, dp: int) -> tuple[int, float, int]:
    """(sequence length, rows, micro-batches per update and DP rank) of the micro-batch the
    activations are sized for. By row count: micro_batch_size rows of rollout.engines.max_model_len.
    Under a token budget (ppo/microbatch.py) a micro-batch holds rows x padded length <= budget
    tokens, each row at most max_model_len: activations grow with its tokens and, through
    attention scores, with its length, so budget / max_model_len rows of max_model_len bound
    every micro-batch the plan can make; and there may be as many micro-batches as rows (each
    long row alone), the most 1F1B keeps in flight."""
    t, seq = cfg.train, cfg.rollout.engines.max_model_len
    rows = cfg.samples_per_step // t.mini_batches // dp
    if t.max_tokens_per_micro_batch:
        return seq, t.max_tokens_per_micro_batch / seq, max(1, rows)
    return seq, t.rows_per_micro_batch, max(1, rows // t.rows_per_micro_batch)


def trainer_memory(cfg: RootConfig, arch: Arch, lay: Layout, fused: bool = True, rm_arch: Arch | None = None) -> dict:
    """Peak bytes per trainer GPU over its phases, on the worst PP stage, by role.
    fused: the GPU path (Transformer Engine, fused SwiGLU); False: megatron's local spec (CPU).
    On the GPU path stage 0 also holds the weight transfer's buffers (`transfer_buffers`): its
    first GPU is global rank 0, the sender. They are counted in every phase, a safe bound
    (memory.transfer_buffer_bytes says why). The CPU path has none."""
    t, tp, pp, dp = cfg.train, lay.tp, lay.pp, lay.dp
    sender = transfer_buffers(cfg, arch) if fused else 0
    div, wb = cfg.model.make_vocab_size_divisible_by, mem.DTYPE_BYTES[cfg.model.dtype]
    seq, mbs, micro = largest_micro_batch(cfg, dp)
    # the distributed optimizer shards dense parameters' state over DP, experts' over expert DP
    per_param = mem.trainable_bytes_per_param(cfg.model.dtype, dp)
    per_expert = mem.trainable_bytes_per_param(cfg.model.dtype, lay.edp) if arch.moe else per_param
    ppo = ADVANTAGES.get(cfg.algo.name).needs_critic   # a critic to place
    sp = cfg.parallel.sequence_parallel
    worst = None

    def params(role, stage):
        return mem.stage_param_split(arch, tp, pp, stage, role, div, lay.ep, lay.etp)

    def trainable(role, stage):
        dense, local_experts = params(role, stage)
        if plan_lora.adapted(cfg, role):   # the base frozen (weights only), the adapters trained
            head = arch.hidden if role == "critic" and stage == pp - 1 else 0   # a critic's new value head
            adapters = stage_adapters(cfg, arch, lay, role, stage)
            return plan_lora.adapted_model_bytes(dense + local_experts - head, adapters, head, per_param, wb)
        return {k: dense * per_param[k] + local_experts * per_expert[k] for k in per_param}

    for stage in range(pp):
        actor = trainable("actor", stage)
        critic = trainable("critic", stage) if ppo else {"weights": 0, "grads": 0, "optimizer": 0}
        # built only for a KL term; with LoRA the reference is the actor with its adapters off: no copy
        ref = sum(params("reference", stage)) * wb if cfg.algo.uses_reference and not plan_lora.lora_of(cfg) else 0
        # a reward model is built with the trainer's layout too (its own experts, if any, over EP)
        rm = mem.stage_params(rm_arch, tp, pp, stage, "reward", div, lay.ep, lay.etp) * wb if rm_arch else 0
        act = dict(seq=seq, mbs=mbs, tp=tp, pp=pp, stage=stage, act_bytes=wb, sequence_parallel=sp,
                   fused=fused, divisible_by=div, etp=lay.etp)
        train_actor = mem.stage_activation_bytes(arch, microbatches=micro, recompute=t.recompute, **act) \
            + adapter_activation_bytes(cfg, arch, lay, "actor", stage, seq * mbs, micro, fused)
        train_critic = mem.stage_activation_bytes(arch, microbatches=micro, recompute=t.recompute,
                                                  with_logits=False, **act) \
            + adapter_activation_bytes(cfg, arch, lay, "critic", stage, seq * mbs, micro, fused)
        fwd = mem.forward_only_bytes(arch, **act)
        fwd_value = mem.forward_only_bytes(arch, with_logits=False, **act)
        a, c_model, c_opt = sum(actor.values()), critic["weights"] + critic["grads"], critic["optimizer"]
        transfer = sender if stage == 0 else 0
        # routing replay's routes: the step's batch of them and the largest pass's int64 indices
        held_routes = routes.device_route_bytes(cfg.algo.routing_replay, arch, cfg.samples_per_step, seq, dp,
                                                mem.stage_layers(arch, pp, stage), tp if sp else 1)
        # phase -> (models resident besides the base, activations of the phase)
        if t.offload_idle:   # always resident: actor + the critic's Adam state (offload.py frees weights+grads only)
            base = a + c_opt + transfer + held_routes
            phases = {"old logprobs (actor forward)": (0, fwd), "reference logprobs": (ref, fwd),
                      "actor update": (0, train_actor)}
            if ppo:
                phases["values (critic forward)"] = (c_model, fwd_value)
                phases["critic update"] = (c_model, train_critic)
            if rm:
                phases["reward model"] = (rm, fwd_value)
        else:
            base = a + c_model + c_opt + ref + rm + transfer + held_routes
            phases = {"old logprobs (actor forward)": (0, fwd), "actor update": (0, train_actor)}
            if ppo:
                phases["critic update"] = (0, train_critic)
        totals = {k: base + extra + acts for k, (extra, acts) in phases.items()}
        phase = max(totals, key=totals.get)
        res = {"stage": stage, "phase": phase, "peak_bytes": totals[phase], "phases": totals,
               "roles": {"actor": actor, "critic": critic, "reference": ref, "reward": rm,
                         "weight_transfer": transfer, "routes": held_routes, "activations": phases[phase][1]},
               "microbatches": micro, "in_flight": mem.in_flight_microbatches(pp, stage, micro)}
        if plan_lora.lora_of(cfg):   # the actor's adapters on this GPU, apart: what LoRA trains and costs
            res["lora"] = lora_figures(cfg, arch, lay, stage, actor, ppo)
        if stage == 0:
            sender_peak = totals[phase]
        if worst is None or res["peak_bytes"] > worst["peak_bytes"]:
            worst = res
    # the sender's buffers and its GPU's peak, also when another stage is the worst
    worst.update(sender_bytes=sender, sender_peak_bytes=sender_peak,
                 route_host_bytes=routes.host_route_bytes(cfg.algo.routing_replay, arch, cfg.samples_per_step, seq))
    return worst


def stage_adapters(cfg: RootConfig, arch: Arch, lay: Layout, role: str, stage: int) -> int:
    """LoRA adapter elements of `role` on one GPU of PP stage `stage` (0: none, trained in full)."""
    own = plan_lora.adapted(cfg, role)
    if not own:
        return 0
    return plan_lora.adapter_params(arch, own.rank, own.targets, lay.tp, len(mem.stage_layers(arch, lay.pp, stage)))


def adapter_activation_bytes(cfg: RootConfig, arch: Arch, lay: Layout, role: str, stage: int, tokens: float,
                             micro: int, fused: bool = True) -> float:
    """What `role`'s adapters keep for backward on one GPU of `stage` (lora.layer_activation_bytes
    per layer; `fused`: the GPU path): every layer of every in-flight micro-batch, or with
    train.recompute=full the one layer recomputed at a time (the layer inputs it keeps are the
    base's)."""
    own = plan_lora.adapted(cfg, role)
    if not own:
        return 0.0
    wb = mem.DTYPE_BYTES[cfg.model.dtype]
    each = plan_lora.layer_activation_bytes(arch, own, tokens, lay.tp, wb, 1 if fused else wb)
    if cfg.train.recompute == "full":
        return each
    return mem.in_flight_microbatches(lay.pp, stage, micro) * len(mem.stage_layers(arch, lay.pp, stage)) * each


def lora_figures(cfg: RootConfig, arch: Arch, lay: Layout, stage: int, actor: dict, ppo: bool) -> dict:
    """The actor's LoRA share of one GPU of `stage`, as the plan prints it: its adapters, their
    gradients and (adapter-only) optimizer state, the frozen base beside them."""
    lora, wb = cfg.model.lora, mem.DTYPE_BYTES[cfg.model.dtype]
    n = stage_adapters(cfg, arch, lay, "actor", stage)
    return {"rank": lora.rank, "targets": list(lora.targets), "adapter_params": n, "adapter_bytes": n * wb,
            "grads": actor["grads"], "optimizer": actor["optimizer"], "base_bytes": actor["weights"] - n * wb,
            "critic": bool(plan_lora.adapted(cfg, "critic")) and ppo}


def candidate_layouts(arch: Arch, gpus: int, gpus_per_node: int, etp: int = 0, sequence_parallel: bool = True):
    """Every TP x PP x DP (x EP for an MoE model) the code accepts on `gpus` GPUs, TP within a
    node. etp: the expert TP (0: megatron's default, = TP). An MoE model over TP > 1 needs
    sequence parallelism: without it only TP = 1 is offered."""
    for tp in range(1, min(gpus_per_node, arch.kv_heads) + 1):
        if arch.kv_heads % tp or arch.heads % tp or (arch.moe and tp > 1 and not sequence_parallel):
            continue
        for pp in range(1, arch.layers + 1):
            if arch.layers % pp or gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            if not arch.moe:
                yield Layout(tp, pp, dp)
                continue
            for ep in divisors(arch.experts):
                lay = Layout(tp, pp, dp, ep, etp or tp)
                if not check_expert_world(arch, lay):
                    yield lay


def with_layout(cfg: RootConfig, lay: Layout) -> RootConfig:
    """The recipe with the layout's TP, PP and EP."""
    return replace(cfg, parallel=replace(cfg.parallel, tp=lay.tp, pp=lay.pp, ep=lay.ep))


def best_layout(cfg, arch, gpus, gpus_per_node, fused, rm_arch) -> tuple[Layout, float] | None:
    """The layout of `gpus` GPUs with the lowest peak (ties: least PP, then least TP, then least EP)."""
    best = None
    for lay in candidate_layouts(arch, gpus, gpus_per_node, sequence_parallel=cfg.parallel.sequence_parallel):
        try:
            validate_world(with_layout(cfg, lay), gpus)
        except ConfigError:
            continue
        peak = trainer_memory(cfg, arch, lay, fused, rm_arch)["peak_bytes"]
        key = (peak, lay.pp, lay.tp, lay.ep)
        if best is None or key < best[0]:
            best = (key, lay)
    return (best[1], best[0][0]) if best else None


def layout_setting(lay: Layout, arch: Arch) -> str:
    """The settings that give this layout, as a fix names them."""
    return f"parallel.tp={lay.tp} parallel.pp={lay.pp}" + (f" parallel.ep={lay.ep}" if arch.moe else "")


def trainer_fixes(cfg, arch, lay, gpus, gpn, fused, rm_arch, usable) -> str:
    """Concrete changes with the peak each gives (same formulas), the fitting ones first."""
    t, opts = cfg.train, []

    def peak(c, layout):
        return trainer_memory(c, arch, layout, fused, rm_arch)["peak_bytes"]

    if not t.offload_idle:
        opts.append(("train.offload_idle=true", peak(replace(cfg, train=replace(t, offload_idle=True)), lay)))
    if t.recompute == "none":
        opts.append(("train.recompute=full", peak(replace(cfg, train=replace(t, recompute="full")), lay)))
    budget, longest = t.max_tokens_per_micro_batch, cfg.rollout.engines.max_model_len
    if budget and budget // 2 >= longest:
        half = replace(t, max_tokens_per_micro_batch=budget // 2)
        opts.append((f"train.max_tokens_per_micro_batch={budget // 2}", peak(replace(cfg, train=half), lay)))
    elif budget > longest:
        least = replace(t, max_tokens_per_micro_batch=longest)
        opts.append((f"train.max_tokens_per_micro_batch={longest}", peak(replace(cfg, train=least), lay)))
    elif not budget and t.rows_per_micro_batch > 1:
        opts.append(("train.micro_batch_size=1", peak(replace(cfg, train=replace(t, micro_batch_size=1)), lay)))
    best = best_layout(cfg, arch, gpus, gpn, fused, rm_arch)
    if best and (best[0].tp, best[0].pp, best[0].ep) != (lay.tp, lay.pp, lay.ep):
        opts.append((layout_setting(best[0], arch), best[1]))
    ws = cfg.weight_sync
    if transfer_buffers(cfg, arch):   # only global rank 0 holds them, but it may be the one that does not fit
        def sync(**kw):
            return peak(replace(cfg, weight_sync=replace(ws, **kw)), lay)
        if ws.num_buffers > 1:
            opts.append(("weight_sync.num_buffers=1 (no overlap of gather and send)", sync(num_buffers=1)))
        if ws.bucket_mb > 128:
            opts.append(("weight_sync.bucket_mb=128", sync(bucket_mb=128)))
        opts.append(("weight_sync.transport=files (staged on disk, slower)", sync(transport="files")))
    lora = plan_lora.lora_of(cfg)
    if lora and ADVANTAGES.get(cfg.algo.name).needs_critic and not lora.critic:   # a LoRA actor, a full critic
        frozen = replace(cfg, model=replace(cfg.model, lora=replace(lora, critic=True)))
        opts.append(("model.lora.critic=true (the critic's base frozen too)", peak(frozen, lay)))
    more = replace(lay, dp=lay.dp * 2)
    opts.append((f"twice the trainer nodes (dp={more.dp}: Adam state sharded twice as thin)", peak(cfg, more)))
    opts.sort(key=lambda o: o[1])
    return "; ".join(f"{name} -> {gib(p)} GiB" + (" (fits)" if p <= usable else "") for name, p in opts)
