"""`megarl simulate RECIPE`: a recipe's rollout settings on simulated hardware.

The recipe gives the schedule (groups per step, n, concurrency, engines, staleness bound,
generation budget, PPO or GRPO); the command line gives what a recipe does not hold: the
response-length distribution and the hardware, either measured on this machine
(`--calibration`, a `bench/rollout_speedup.py` result) or a GPU roofline (`--gpu`, `--model`,
`--engine-tp`, `--trainer-gpus`). The weight sync takes the recipe's route
(weight_sync.transport: a broadcast or sharded sends, staged or not; or files every engine
reads), printed with the seconds it pauses the engines per push. Prints step time, engine
busy and trainer idle fractions and trained tokens/s for sync, partial and async mode, the recipe's own mode marked,
each under the recipe's rollout.update_mode, rollout.keep_kv and rollout.overlap (sync: no overlap). A
roofline trainer computes the positions of the recipe's batching rule (padding included:
costs.StepShape); every mode also runs with the padded trainer (every row at the step's
longest), printed beside it.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace

from megarl.config import ConfigError, load_config
from megarl.config.registry import ADVANTAGES
from megarl.plan import lora as plan_lora
from megarl.ppo.microbatch import batching_of
from megarl.sim.costs import (
    GPUS,
    MODEL_FACTS,
    MeasuredEngine,
    MeasuredTrainer,
    Model,
    RooflineEngine,
    RooflineTrainer,
    StepShape,
    interp,
    published_models,
)
from megarl.sim.push import WeightSyncCosts
from megarl.sim.run import MODES, SimSettings, simulate
from megarl.sim.workload import Workload, parse_dist


def measured_costs(path: str, cfg=None):
    """Engine and trainer models from a bench/rollout_speedup.py result JSON.

    The weight sync is the bench's measured push (its mean, as the engines' load), taken by
    the bench's own route (the result's `weight_sync.transport`; results without it predate
    the collective transport and pushed files). With `cfg` (the recipe) and the same route,
    it follows the recipe's engine count: a broadcast costs the same for any number of
    engines, files are read by every engine, so that push scales with engines / the bench's."""
    try:
        r = json.loads(open(path).read())
        curve = {int(b): t for b, t in r["decode_step_s"].items()}
        ovh, C, E = r["overheads"], r["concurrency"], r["engines"]
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"--calibration {path!r}: not a bench/rollout_speedup.py result ({err!r}); "
                          f"run that benchmark first or use --gpu") from None
    request_s = max(0.0, ovh["request_s"] - interp(curve, C / E) / (C / E))
    pushes = [s["push_s"] for m in r["per_step"] for s in r["per_step"][m]]
    trains = [s for m in r["per_step"] for s in r["per_step"][m]]
    per_token = sum(s["train_s"] for s in trains) / max(1, sum(s["tokens"] for s in trains))
    push = sum(pushes) / len(pushes)
    bench_route = r.get("weight_sync", {}).get("transport", "files")
    if cfg is not None and cfg.weight_sync.transport == bench_route == "files":
        push *= cfg.rollout.engines.count / E
    return (MeasuredEngine(curve, ovh["prefill_s_per_token"], request_s, push),
            MeasuredTrainer(0.0, per_token, route=f"measured ({bench_route}, {E} engines in the bench)"))


def roofline_model(cfg, model: str = "") -> Model:
    """--model NAME (recipes/models/NAME.yaml, "_" written "-"), else the recipe's own model
    (model.arch, else model.path/config.json)."""
    if not model:
        from megarl.plan import resolve_arch
        arch, _ = resolve_arch(cfg)
        return Model.from_arch(cfg.model.path, arch)
    known = published_models()
    if model not in known:
        raise ConfigError(f"--model {model!r}: choose one of {sorted(known)} (recipes/models/), "
                          f"or leave it out for the recipe's own model")
    return known[model]


def model_arch(cfg, model: str = ""):
    """The architecture facts of `roofline_model(cfg, model)`'s model."""
    from megarl.plan import resolve_arch
    if not model:
        return resolve_arch(cfg)[0]
    roofline_model(cfg, model)   # an unknown name: its one line
    return resolve_arch(load_config(str(MODEL_FACTS / f"{model.replace('-', '_')}.yaml")))[0]


def lora_params(cfg, model: str = "") -> tuple[float, float]:
    """(the actor's LoRA adapter parameters as the trainer holds them, as PEFT and vLLM hold
    them: plan/lora.py) at the model the simulator prices; (0, 0) without LoRA. The first is
    what a LoRA trainer trains, the second what a push of the adapters carries and an engine
    serves."""
    lora = plan_lora.lora_of(cfg)
    if not lora:
        return 0.0, 0.0
    a = model_arch(cfg, model)
    return (float(plan_lora.adapter_params(a, lora.rank, lora.targets)),
            float(plan_lora.peft_params(a, lora.rank, lora.targets)))


def pushed_bytes(cfg, m: Model, peft: float) -> float:
    """Bytes one push carries: the model's weights, or the adapters alone in PEFT's form (`peft`
    parameters; weight_sync.lora=adapters), at the model's bytes per parameter."""
    return peft * m.bytes_per_param if plan_lora.adapters_pushed(cfg) else m.weight_bytes


def served_model(cfg, m: Model, peft: float) -> Model:
    """The model an engine computes with: with weight_sync.lora=adapters vLLM serves the base and
    the adapters beside it (`peft` parameters, read and multiplied every step: x A then B);
    merged weights, or no LoRA, are the model itself."""
    if not plan_lora.adapters_pushed(cfg):
        return m
    return replace(m, params=m.params + peft, active_params=m.active + peft)


def trainer_gpus(cfg) -> int:
    """The trainer's GPUs in the recipe's cluster section; 8 (one node) for a CPU recipe."""
    c = cfg.cluster
    return c.trainer_node_count * c.gpus_per_node if c.gpus_per_node else 8


def step_shape(cfg, trainer_gpus: int, padded: bool = False) -> StepShape:
    """The recipe's batching rule over its trainer's DP ranks (`padded`: every row at the
    step's longest, the layout before length-aware batching)."""
    batching = batching_of(cfg)
    if padded:
        batching = replace(batching, max_tokens=0, remove_padding=False)
    dp = max(1, trainer_gpus // (cfg.parallel.tp * cfg.parallel.pp))
    return StepShape(batching, dp, cfg.train.mini_batches)


def shard_owners(cfg, trainer_gpus: int) -> int:
    """The trainer's distinct shard owners, TP x PP x EP (EP: parallel.ep, 1 for a dense model),
    at most its GPUs: what a sharded push (weight_sync.sharded) divides a trainer link's bytes by."""
    p = cfg.parallel
    return max(1, min(trainer_gpus, p.tp * p.pp * max(1, getattr(p, "ep", 1))))


def push_cost(cfg, m: Model, gpu, engines: int, engine_tp: int, trainer_gpus: int,
              sync: WeightSyncCosts | None = None, peft: float = 0.0):
    """One sync by the recipe's route: weight_sync.transport, .staged, .sharded (push.PushCost),
    of the model's weights or, with LoRA and weight_sync.lora=adapters, of its adapters (`peft`
    parameters in PEFT's form)."""
    ws, sync = cfg.weight_sync, sync or WeightSyncCosts()
    # the adapters travel unstaged and gathered on rank 0 (rollout/weights/adapters.py): megabytes
    whole = plan_lora.adapters_pushed(cfg)
    return sync.push(ws.transport, pushed_bytes(cfg, m, peft), engines, engine_tp, gpu, staged=ws.staged and not whole,
                     sharded=ws.sharded and not whole, owners=shard_owners(cfg, trainer_gpus))


def roofline_costs(cfg, gpu: str, model: str, engine_tp: int, trainer_gpus: int, engines: int = 0):
    """(engine, trainer) cost models on `gpu` (`engines`: rollout.engines.count unless given)."""
    if gpu not in GPUS:
        raise ConfigError(f"--gpu {gpu!r}: choose one of {sorted(GPUS)}")
    m, g = roofline_model(cfg, model), GPUS[gpu]
    adapters, peft = lora_params(cfg, model)
    # the recipe's route: a broadcast or sharded sends, staged or not; or files read by every engine
    push = push_cost(cfg, m, g, engines or cfg.rollout.engines.count, engine_tp, trainer_gpus, peft=peft)
    trainer = RooflineTrainer(m, g, trainer_gpus, critic=ADVANTAGES.get(cfg.algo.name).needs_critic,
                              push_s=push.trainer_s, route=cfg.weight_sync.transport,
                              shape=step_shape(cfg, trainer_gpus), push_cost=push, adapter_params=adapters,
                              critic_adapters=bool(plan_lora.adapted(cfg, "critic")))
    return RooflineEngine(served_model(cfg, m, peft), g, engine_tp, load_weights_s=push.paused_s), trainer


def route_name(cfg, push) -> str:
    """The route as printed: the transport, for collective whether staged / sharded, and with
    LoRA what travels (weight_sync.lora: the adapters alone, or merged weights)."""
    lora = f", LoRA {plan_lora.push_mode(cfg)}" if plan_lora.push_mode(cfg) else ""   # adapters only, or merged
    if cfg.weight_sync.transport != "collective":
        return cfg.weight_sync.transport + lora
    return "collective, " + ("staged" if push.staged else "unstaged") + ", " + (
        "sharded" if push.sharded else "gathered on rank 0") + lora


def default_lengths(cfg) -> str:
    """The response lengths `megarl simulate` assumes without --lengths: lognormal with its
    median at a quarter of rollout.sampling.max_new_tokens and sigma 1 (capped at the budget)."""
    median = max(1.0, cfg.rollout.sampling.max_new_tokens / 4)
    return f"lognormal:mu={math.log(median):.3g},sigma=1"


def run(cfg, lengths: str, costs, steps: int, seed: int = 0) -> dict:
    """Every mode's figures on this recipe; `lengths` "" takes default_lengths(cfg)."""
    given = bool(lengths)
    lengths = lengths or default_lengths(cfg)
    try:
        dist = parse_dist(lengths)
    except ValueError as err:
        raise ConfigError(f"--lengths: {err}") from None
    r = cfg.rollout
    stats = Workload(dist, r.sampling.n, r.sampling.max_new_tokens, seed).stats(500)
    source = "--lengths" if given else (f"the recipe's default: median rollout.sampling.max_new_tokens / 4 = "
                                        f"{r.sampling.max_new_tokens} / 4; --lengths to change")
    recipe_mode = "sync" if r.mode == "sync" else ("async" if r.partial.asynchronous else "partial")
    engine, trainer = costs
    out = {"recipe_mode": recipe_mode, "modes": {},
           "lengths": {"spec": lengths, "from": source, "max_new_tokens": r.sampling.max_new_tokens, **stats},
           "weight_sync": weight_sync_figures(cfg, engine, trainer)}
    # the padded trainer beside the recipe's (a trainer whose padding is modelled: roofline)
    shape = getattr(trainer, "shape", None)
    padded = replace(trainer, shape=step_shape(cfg, trainer.gpus, padded=True)) if shape else None
    if padded is not None:
        out["padded"] = {}
    for mode in MODES:
        out["modes"][mode] = simulate_mode(cfg, dist, mode, costs, steps, seed)
        if padded is not None:
            out["padded"][mode] = simulate_mode(cfg, dist, mode, (engine, padded), steps, seed)
    add_ceilings(out["modes"])
    return out


def mode_settings(cfg, mode: str, steps: int, seed: int = 0) -> SimSettings:
    """The recipe's rollout settings for `mode` (async: a staleness bound of at least 1; sync:
    no overlap)."""
    r = cfg.rollout
    return SimSettings(mode=mode, steps=steps, groups_per_step=cfg.train.groups_per_step,
                       concurrency=r.partial.concurrency, engines=r.engines.count,
                       max_staleness=max(r.partial.max_staleness, 1) if mode == "async" else r.partial.max_staleness,
                       stale_policy=r.partial.stale_policy, seed=seed, update_mode=r.update_mode,
                       keep_kv=r.keep_kv, overlap=r.overlap and mode != "sync",
                       max_step_multiple=r.partial.max_step_multiple)


def simulate_mode(cfg, dist, mode: str, costs, steps: int, seed: int = 0) -> dict:
    """One mode of the recipe on `costs` (engine, trainer): its figures (`_figures`)."""
    r = cfg.rollout
    engine, trainer = costs
    return _figures(simulate(mode_settings(cfg, mode, steps, seed),
                             Workload(dist, r.sampling.n, r.sampling.max_new_tokens, seed), engine, trainer), steps)


def weight_sync_figures(cfg, engine, trainer) -> dict:
    """One sync: trainer side (the engines still generate), paused (every engine, in parallel),
    and with a modelled push (roofline) its wire seconds and bytes per link."""
    out = {"transport": cfg.weight_sync.transport, "route": trainer.route,
           "trainer_s": trainer.push_s, "engine_s": engine.load_weights_s, "paused_s": engine.load_weights_s}
    push = getattr(trainer, "push_cost", None)
    if push is not None:
        out.update(route=route_name(cfg, push), wire_s=push.wire_s, load_s=push.load_s, staged=push.staged,
                   sharded=push.sharded, send_bytes=push.send_bytes, recv_bytes=push.recv_bytes)
    return out


def add_ceilings(modes: dict) -> None:
    """Each mode's ceiling: the sync step over the mode's ideal step (per groups_per_step
    groups: train + push + ideal rollout; async: the larger of train + push and the ideal
    rollout), beside the speedup it reaches (sync step / its own)."""
    sync = modes["sync"]["unit_s"]
    for m in modes.values():
        m["speedup"] = sync / m["unit_s"]
        m["ceiling"] = sync / m["ideal_unit_s"]
        m["of_ceiling"] = m["speedup"] / m["ceiling"]


def _figures(res: dict, steps: int) -> dict:
    return {k: res[k] for k in ("step_s_mean", "engine_busy_frac", "trainer_idle_frac", "trained_tokens_per_s",
                                "staleness_max", "requests_per_trained_sample", "reprefill_tokens",
                                "multi_version_tokens", "computed_per_real", "unit_s", "ideal_unit_s",
                                "rollout_unit_s", "train_unit_s", "push_unit_s", "units")} | {
        "rollout_s_mean": res["rollout_s"] / steps, "train_s_mean": res["train_s"] / steps,
        "overlap_s_mean": res["overlap_s"] / steps, "groups_per_step_mean": res["groups_trained"] / steps}


def format_table(result: dict) -> str:
    lines = [lengths_line(result["lengths"])] if "lengths" in result else []
    lines.append("mode      step s  rollout s  train s  engine busy  trainer idle  trained tok/s  staleness")
    for mode, m in result["modes"].items():
        mark = "*" if mode == result["recipe_mode"] else " "
        lines.append(f"{mode:8s}{mark} {m['unit_s']:6.2f}  {m['rollout_unit_s']:9.2f}  {m['train_unit_s']:7.2f}  "
                     f"{m['engine_busy_frac']:11.2f}  {m['trainer_idle_frac']:12.2f}  "
                     f"{m['trained_tokens_per_s']:13.0f}  {m['staleness_max']:9d}")
    lines.append("(* the recipe's rollout mode; seconds per train.groups_per_step groups: a partial step trains "
                 "a whole multiple of them, rollout.partial.max_step_multiple)")
    lines.append("mode      speedup  ceiling  of ceiling  groups per step  (ceiling: sync step / (train + push + "
                 "ideal rollout); async: / max(train + push, ideal rollout))")
    for mode, m in result["modes"].items():
        lines.append(f"{mode:8s}  {m['speedup']:7.2f}  {m['ceiling']:7.2f}  {m['of_ceiling']:10.2f}  "
                     f"{m['groups_per_step_mean']:15.1f}")
    lines.append("mode      requests/sample  re-prefilled tokens  tokens of requests over >1 version  overlap s")
    for mode, m in result["modes"].items():
        lines.append(f"{mode:8s}  {m['requests_per_trained_sample']:15.2f}  {m['reprefill_tokens']:19d}  "
                     f"{m['multi_version_tokens']:34d}  {m['overlap_s_mean']:9.2f}")
    if "padded" in result:
        lines.append("trainer     mode      step s  train s  trained tok/s  computed/real tokens")
        for rule, figures in (("padded", result["padded"]), ("recipe's", result["modes"])):
            for mode, m in figures.items():
                lines.append(f"{rule:10s}  {mode:8s}{m['unit_s']:7.2f}  {m['train_unit_s']:7.2f}  "
                             f"{m['trained_tokens_per_s']:13.0f}  {m['computed_per_real']:20.2f}")
        lines.append("(padded: every row at the step's longest; recipe's: its batching rule, "
                     "docs/design.md \"Batching\")")
    lines.append(weight_sync_line(result["weight_sync"]))
    return "\n".join(lines)


def weight_sync_line(ws: dict) -> str:
    """The push per sync: paused seconds, and the wire (bytes per link) where it runs."""
    paused = ws.get("paused_s", ws["engine_s"])   # engine_s: the same figure, its name before issue 47
    line = (f"weight sync ({ws['route']}): engines paused {paused:.2f} s per push; trainer side "
            f"{ws['trainer_s']:.2f} s (engines generating)")
    if "wire_s" in ws:
        where = "engines generating" if ws["staged"] else "engines paused"
        line += (f"; wire {ws['wire_s']:.2f} s ({where}): {ws['send_bytes'] / 1e9:.1f} GB per trainer link, "
                 f"{ws['recv_bytes'] / 1e9:.1f} GB per engine worker link; load {ws['load_s']:.2f} s")
    if ws["route"].endswith("LoRA adapters"):
        # the simulator prices GPUs, and megarl pushes adapters on the gloo wire only
        line += ("\n  (a projection: megarl pushes adapters on the gloo wire only (CPU engines); on GPUs "
                 "weight_sync.lora=merged's figures apply)")
    if ws.get("staged"):
        # the simulator prices GPUs, whose wires (vLLM's nccl / ipc receivers) neither stage nor
        # shard in megarl yet (docs/engines.md "Staged updates"): say the figure is a projection
        line += ("\n  (a projection: megarl stages and shards on the gloo wire only; on GPUs its nccl / ipc "
                 "pushes still pause the engines for the whole push, weight_sync.staged=false's figures)")
    return line


def lengths_line(lengths: dict) -> str:
    """The response lengths the figures assume, as drawn (capped at max_new_tokens)."""
    return (f"response lengths: {lengths['spec']} ({lengths['from']}): mean {lengths['mean']:.0f}, median "
            f"{lengths['median']:.0f}, p90 {lengths['p90']:.0f}, max {lengths['max']} of "
            f"{lengths['max_new_tokens']} tokens")
