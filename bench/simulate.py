#!/usr/bin/env python
"""Projections for GPU clusters: megarl's controller and engine pool on simulated H100/H200s.

    .venv/bin/python bench/simulate.py [--presets 7b,32b,70b] [--steps 5] [--gpu h100]
        [--transport collective|files] [--out bench/out/simulate.json] [--png bench/simulate.png]
        [--anchors]

Per preset (a model family at a cluster size; docs/simulator.md lists the hardware each is
sized for), on a roofline cost model (megarl/sim/costs.py):
- sync, partial and async mode at the preset's concurrency: step time, engine busy fraction,
  trainer idle fraction, trained tokens/s;
- partial and async across concurrency per engine and across rollout.partial.max_staleness;
- the provisioning rule: engines needed to keep the trainer busy in async mode, by the formula
  (`engines_to_keep_trainer_busy`) and by the simulator (the fewest engines for which, after
  the first step, the trainer waits for rollout less than 5% of its train time), side by side;
- the weight sync by route (`WeightSyncCosts`): one broadcast (collective, the default) against
  files written once and read by every engine, at 1 to 16 engines.
--anchors also runs published settings (AReaL's async-vs-sync speedup; a NeMo-Aligner PPO
step) for comparison with their reported figures.
Prints markdown tables (pasted into bench/RESULTS.md) and writes JSON and a PNG.

    .venv/bin/python bench/simulate.py --keep-overlap [--steps 5] [--staleness 4]
        [--out bench/out/simulate_keep.json]

runs only issue 20's comparison (`project_keep`): per preset and staleness bound, sync against
partial and async under rollout.update_mode=abort and keep (rollout.keep_kv false / true), with
and without rollout.overlap: step time, the trainer's time after the round and during it,
requests per trained sample, re-prefilled tokens, tokens of requests that span versions.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megarl.metrics.step import trainer_idle_frac  # noqa: E402
from megarl.sim.costs import (  # noqa: E402
    GPUS,
    Model,
    RooflineEngine,
    RooflineTrainer,
    engines_to_keep_trainer_busy,
    published_models,
    weight_push_s,
)
from megarl.sim.run import SimSettings, simulate  # noqa: E402
from megarl.sim.workload import Workload, parse_dist  # noqa: E402


@dataclass
class Preset:
    model: str
    nodes: int
    gpus_per_node: int
    trainer_gpus: int          # TP x PP x DP of the trainer
    trainer_layout: str
    engine_tp: int
    engines: int
    concurrency: int           # requests in flight over all engines
    groups_per_step: int
    n: int
    prompt_tokens: int
    lengths: str               # response-length distribution
    max_len: int
    critic: bool = True        # PPO (actor + critic + reference); False: GRPO
    transport: str = "collective"   # weight_sync.transport: one broadcast | files every engine reads


PRESETS = {
    "7b": Preset("qwen2.5-7b", 1, 8, 4, "TP1 PP1 DP4", 1, 4, 256, 64, 8, 256,
                 "lognormal:mu=6.5,sigma=0.8", 4096),
    "32b": Preset("qwen2.5-32b", 4, 8, 16, "TP4 PP2 DP2", 2, 8, 512, 64, 8, 256,
                  "lognormal:mu=6.5,sigma=0.8", 4096),
    "70b": Preset("llama3.1-70b", 8, 8, 32, "TP8 PP4 DP1", 4, 8, 512, 64, 8, 256,
                  "lognormal:mu=6.5,sigma=0.8", 4096),
}


DEFAULT_OUT = str(ROOT / "bench/out/simulate.json")


def costs(p: Preset, gpu_name: str, engines: int | None = None):
    model, gpu = published_models()[p.model], GPUS[gpu_name]
    e = engines or p.engines
    send, load = weight_push_s(model, gpu, e, p.engine_tp, p.transport)
    engine = RooflineEngine(model, gpu, p.engine_tp, load_weights_s=load)
    trainer = RooflineTrainer(model, gpu, p.trainer_gpus, critic=p.critic, push_s=send,
                              prompt_tokens=p.prompt_tokens, route=p.transport)
    return engine, trainer


def run(p: Preset, gpu: str, mode: str, steps: int, **over) -> dict:
    engines = over.pop("engines", p.engines)
    engine, trainer = costs(p, gpu, engines)
    w = Workload(parse_dist(p.lengths), p.n, p.max_len, prompt_len=lambda g: p.prompt_tokens)
    s = SimSettings(mode=mode, steps=steps, groups_per_step=p.groups_per_step,
                    concurrency=over.pop("concurrency", p.concurrency), engines=engines,
                    max_staleness=over.pop("max_staleness", 2 if mode != "sync" else 10**9), **over)
    return with_steady_state(simulate(s, w, engine, trainer))


def with_steady_state(r: dict) -> dict:
    """Figures without the first step (async has nothing to overlap with there)."""
    after_first = r["per_step"][1:] or r["per_step"]
    # the trainer works train_s after each round and overlap_s during it
    r["trainer_idle_after_first"] = trainer_idle_frac(sum(x["train_s"] for x in after_first),
                                                      sum(x["step_s"] for x in after_first),
                                                      sum(x["overlap_s"] for x in after_first))
    r["step_s_after_first"] = sum(x["step_s"] for x in after_first) / len(after_first)
    # the trainer waiting for generation (not for the push, which no engine count hides)
    r["rollout_wait_frac"] = sum(x["rollout_s"] for x in after_first) / sum(x["train_s"] for x in after_first)
    return r


def summary(r: dict) -> dict:
    keys = ("step_s_mean", "step_s_after_first", "engine_busy_frac", "trainer_idle_frac",
            "trainer_idle_after_first", "trained_tokens_per_s", "staleness_max",
            "requests_per_trained_sample", "reprefill_tokens", "kv_recomputed_tokens", "multi_version_tokens")
    return {k: r[k] for k in keys} | {"rollout_s_mean": r["rollout_s"] / r["steps"],
                                      "train_s_mean": r["train_s"] / r["steps"],
                                      "overlap_s_mean": r["overlap_s"] / r["steps"],
                                      "overlap_hidden_s_mean": r["overlap_hidden_s"] / r["steps"],
                                      "push_s_mean": r["push_s"] / r["steps"]}


def project(name: str, p: Preset, gpu: str, steps: int) -> dict:
    out = {"preset": vars(p), "gpu": gpu, "modes": {}, "concurrency_sweep": {}, "staleness_sweep": {}}
    for mode in ("sync", "partial", "async"):
        out["modes"][mode] = summary(run(p, gpu, mode, steps))
        print(f"[{name}] {mode}: " + ", ".join(f"{k} {v:.3g}" for k, v in out["modes"][mode].items()), flush=True)
    per_engine = [16, 32, 64, 128]
    for mode in ("partial", "async"):
        out["concurrency_sweep"][mode] = {c * p.engines: summary(run(p, gpu, mode, steps, concurrency=c * p.engines))
                                          for c in per_engine}
        out["staleness_sweep"][mode] = {s: summary(run(p, gpu, mode, steps, max_staleness=s))
                                        for s in ((0, 1, 2, 4) if mode == "partial" else (1, 2, 4))}
    # provisioning: async, same trainer, engines 1..: fewest with the trainer idle < 10%
    engine, trainer = costs(p, gpu)
    w = Workload(parse_dist(p.lengths), p.n, p.max_len)
    mean_len = w.stats(2000)["mean"]
    tokens_per_step = p.groups_per_step * p.n * mean_len
    samples = p.groups_per_step * p.n
    train_s = trainer.train_s(int(tokens_per_step), 0, samples)
    per_engine_conc = p.concurrency / p.engines
    ctx = per_engine_conc * (p.prompt_tokens + mean_len / 2)
    engine_tps = per_engine_conc / engine.step_s(int(per_engine_conc), int(ctx), 0, 0)
    formula = engines_to_keep_trainer_busy(train_s, trainer.push_s + engine.load_weights_s, tokens_per_step,
                                           engine_tps, waste=0.1)
    sim_answer, sweep = None, {}
    for e in range(1, 4 * max(formula, p.engines) + 1):
        r = run(p, gpu, "async", steps, engines=e, concurrency=int(per_engine_conc * e))
        sweep[e] = {"trainer_idle_after_first": r["trainer_idle_after_first"],
                    "rollout_wait_frac": r["rollout_wait_frac"], "step_s_after_first": r["step_s_after_first"]}
        if r["rollout_wait_frac"] < 0.05:   # the trainer waits for rollout < 5% of its train time
            sim_answer = e
            break
    out["provisioning"] = {"formula_engines": formula, "simulated_engines": sim_answer,
                           "train_s": train_s, "tokens_per_step": tokens_per_step,
                           "engine_tokens_per_s": engine_tps, "engine_tp": p.engine_tp,
                           "concurrency_per_engine": per_engine_conc, "sweep": sweep}
    print(f"[{name}] provisioning: formula {formula} engines (TP{p.engine_tp}), simulator {sim_answer}", flush=True)
    return out


# -- issue 20: keep-mode weight updates and intra-step overlap ------------------------------
KEEP_CASES = [   # (label, mode, update_mode, keep_kv, overlap)
    ("sync", "sync", "abort", False, False),
    ("partial abort", "partial", "abort", False, False),
    ("partial keep, keep_kv=false", "partial", "keep", False, False),
    ("partial keep, keep_kv=true", "partial", "keep", True, False),
    ("partial keep + overlap", "partial", "keep", False, True),
    ("async abort", "async", "abort", False, False),
    ("async keep, keep_kv=false", "async", "keep", False, False),
    ("async keep + overlap", "async", "keep", False, True),
]


def project_keep(name: str, p: Preset, gpu: str, steps: int, staleness: list[int]) -> dict:
    """Every KEEP_CASES case of preset `p` at each staleness bound (sync: unbounded); the
    forward-only share the overlap hides is the roofline's (RooflineTrainer.forward_frac)."""
    out = {"preset": vars(p), "gpu": gpu, "forward_frac": costs(p, gpu)[1].forward_frac, "cases": {}}
    for bound in staleness:
        for label, mode, update_mode, keep_kv, overlap in KEEP_CASES:
            if mode == "sync" and bound != staleness[0]:
                continue   # no bound applies to sync: once
            over = {} if mode == "sync" else {"max_staleness": bound}
            t = time.perf_counter()
            r = summary(run(p, gpu, mode, steps, update_mode=update_mode, keep_kv=keep_kv, overlap=overlap, **over))
            key = label if mode == "sync" else f"S={bound} {label}"
            out["cases"][key] = r | {"mode": mode, "update_mode": update_mode, "keep_kv": keep_kv,
                                     "overlap": overlap, "max_staleness": None if mode == "sync" else bound}
            print(f"[{name}] {key}: step {r['step_s_after_first']:.1f} s, overlap {r['overlap_s_mean']:.1f} s "
                  f"(spared {r['overlap_hidden_s_mean']:.1f} s), "
                  f"requests/sample {r['requests_per_trained_sample']:.2f} ({time.perf_counter() - t:.0f} s)",
                  flush=True)
    return out


def print_keep_table(results: dict, steps: int) -> None:
    print("\n| preset | case | step s | rollout s | train s after round | trainer s during round (of it spared "
          "after) | trainer idle | requests / trained sample | re-prefilled tok / step | of which KV recomputed | "
          "tok of requests over >1 version / step | trained tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        for key, m in r["cases"].items():
            print(f"| {name} | {key} | {m['step_s_after_first']:.1f} | {m['rollout_s_mean']:.1f} | "
                  f"{m['train_s_mean']:.1f} | {m['overlap_s_mean']:.1f} ({m['overlap_hidden_s_mean']:.1f}) | "
                  f"{m['trainer_idle_after_first']:.2f} | "
                  f"{m['requests_per_trained_sample']:.2f} | {m['reprefill_tokens'] / steps:.0f} | "
                  f"{m['kv_recomputed_tokens'] / steps:.0f} | {m['multi_version_tokens'] / steps:.0f} | "
                  f"{m['trained_tokens_per_s']:.0f} |")


def main_keep(a, presets: dict) -> None:
    t0 = time.perf_counter()
    bounds = [int(x) for x in a.staleness.split(",")]
    results = {name: project_keep(name, p, a.gpu, a.steps, bounds) for name, p in presets.items()}
    out = a.out if a.out != DEFAULT_OUT else str(ROOT / "bench/out/simulate_keep.json")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"gpu": a.gpu, "steps": a.steps, "presets": results}, indent=1))
    print_keep_table(results, a.steps)
    print(f"\nwrote {out} in {time.perf_counter() - t0:.0f} s")


# -- anchors -------------------------------------------------------------------------------
AREAL_15B = Model("DeepSeek-R1-Distill-Qwen-1.5B", 1.78e9, 28, 1536, 2, 128)


def anchor_areal(steps: int) -> dict:
    """AReaL (arXiv 2505.24298), 1.5B math: 16 nodes x 8 H800, 3/4 of the GPUs generate,
    synchronous AReaL 41.0 h vs asynchronous 14.8 h for the same steps (2.77x), staleness 8.
    Scaled by 1/8 (12 engines of TP1, 4 trainer GPUs, 1/8 of the batch: ratios unchanged).
    Their batch: 512 prompts x 16 answers; lengths up to 27k tokens (ours: lognormal with a
    mean near 9k, an assumption). H800 ~ H100 compute and HBM."""
    gpu = GPUS["h100"]
    p = Preset("areal", 16, 8, 4, "DP4 (1/8 of 32)", 1, 12, 12 * 64, 64, 16 // 2 * 2, 1024,
               "lognormal:mu=8.9,sigma=0.6", 27648, critic=False)
    p = replace(p, groups_per_step=512 // 8, n=16)
    send, load = weight_push_s(AREAL_15B, gpu, p.engines, 1, p.transport)
    engine = RooflineEngine(AREAL_15B, gpu, 1, load_weights_s=load)
    trainer = RooflineTrainer(AREAL_15B, gpu, p.trainer_gpus, critic=False, push_s=send,
                              prompt_tokens=p.prompt_tokens)
    w = Workload(parse_dist(p.lengths), p.n, p.max_len, prompt_len=lambda g: p.prompt_tokens)
    res = {}
    for mode in ("sync", "async"):
        s = SimSettings(mode=mode, steps=steps, groups_per_step=p.groups_per_step, concurrency=p.concurrency,
                        engines=p.engines, max_staleness=8 if mode == "async" else 10**9)
        res[mode] = summary(with_steady_state(simulate(s, w, engine, trainer)))
    return {"reported_speedup": 41.0 / 14.8, "simulated_speedup": res["sync"]["step_s_after_first"]
            / res["async"]["step_s_after_first"], "modes": res, "lengths": w.stats(500)}


def anchor_nemo_aligner(steps: int) -> dict:
    """NeMo-Aligner (arXiv 2405.01481, docs/user-guide/rlhf.rst): Llama 3 70B actor + 70B critic,
    8 actor nodes + 4 critic nodes of 8 H100, 1024 rollout samples, 350.7 tokens generated on
    average, step 366.7 s; generation colocated on the actor's 64 GPUs (TensorRT-LLM, reshard
    on) and PPO sync. Modelled: 16 engines of TP4 on the actor GPUs (colocated: generation and
    training alternate), trainer = the 96 GPUs' training (actor 64 + critic 32)."""
    gpu = GPUS["h100"]
    model = published_models()["llama3.1-70b"]
    send, load = weight_push_s(model, gpu, 16, 4, "collective")
    engine = RooflineEngine(model, gpu, 4, load_weights_s=load)
    trainer = RooflineTrainer(model, gpu, 96, critic=True, push_s=send, prompt_tokens=256)
    w = Workload(parse_dist("lognormal:mu=5.6,sigma=0.6"), 1, 2048, prompt_len=lambda g: 256)
    s = SimSettings(mode="sync", steps=steps, groups_per_step=1024, concurrency=1024, engines=16)
    r = summary(with_steady_state(simulate(s, w, engine, trainer)))
    return {"reported_step_s": 366.7, "simulated_step_s": r["step_s_after_first"], "sim": r,
            "lengths": w.stats(500)}


def push_by_route(p: Preset, gpu: str) -> dict:
    """Seconds of one weight sync (trainer side + engine side) by route and engine count: the
    broadcast's bytes leave once, the files are read by every engine."""
    model = published_models()[p.model]
    return {route: {e: sum(weight_push_s(model, GPUS[gpu], e, p.engine_tp, route)) for e in (1, 2, 4, 8, 16)}
            for route in ("collective", "files")}


def plot(results: dict, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.25
    for i, mode in enumerate(("sync", "partial", "async")):
        xs = [k + (i - 1) * width for k in range(len(names))]
        axes[0].bar(xs, [results[n]["modes"][mode]["step_s_after_first"] for n in names], width, label=mode)
    axes[0].set_xticks(range(len(names)), names)
    axes[0].set_ylabel("step time, s (after the first)")
    axes[0].set_title("step time by mode")
    axes[0].legend()
    for n in names:
        sweep = results[n]["concurrency_sweep"]["partial"]
        cs = sorted(sweep, key=int)
        axes[1].plot([int(c) for c in cs], [sweep[c]["trained_tokens_per_s"] for c in cs], marker="o",
                     label=f"{n} partial")
        sweep = results[n]["concurrency_sweep"]["async"]
        axes[1].plot([int(c) for c in cs], [sweep[c]["trained_tokens_per_s"] for c in cs], marker="s",
                     linestyle="--", label=f"{n} async")
    axes[1].set_xscale("log", base=2)
    axes[1].set_yscale("log")
    axes[1].set_xlabel("concurrency (requests in flight, all engines)")
    axes[1].set_ylabel("trained tokens / s")
    axes[1].set_title("throughput vs concurrency")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="7b,32b,70b")
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--anchors", action="store_true")
    p.add_argument("--transport", default="collective", choices=("collective", "files"),
                   help="weight_sync.transport of the presets (default: collective, megarl's default)")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--keep-overlap", action="store_true",
                   help="only issue 20's comparison: update_mode keep / abort, keep_kv, overlap (project_keep)")
    p.add_argument("--staleness", default="4",
                   help="--keep-overlap: the max_staleness bounds to compare (4: samples are carried over "
                        "rounds; at 2 these presets carry none, so keep and abort coincide)")
    p.add_argument("--png", default=str(ROOT / "bench/simulate.png"))
    a = p.parse_args()
    presets = {name: replace(PRESETS[name], transport=a.transport) for name in a.presets.split(",") if name}
    if a.keep_overlap:
        main_keep(a, presets)
        return
    t0 = time.perf_counter()
    out = {"gpu": a.gpu, "steps": a.steps}
    if a.anchors:
        out["anchors"] = {"areal": anchor_areal(a.steps), "nemo_aligner_70b": anchor_nemo_aligner(a.steps)}
        print("anchors:", json.dumps({k: {kk: vv for kk, vv in v.items() if not isinstance(vv, dict)}
                                      for k, v in out["anchors"].items()}), flush=True)
    results = {name: project(name, p, a.gpu, a.steps) for name, p in presets.items()}
    for name, p in presets.items():
        results[name]["push_by_route"] = push_by_route(p, a.gpu)
    out["presets"] = results
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    if results:
        plot(results, a.png)

    print("\n| preset | mode | step s | rollout s | train s | push s | engine busy | trainer idle | trained tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        for mode, m in r["modes"].items():
            print(f"| {name} | {mode} | {m['step_s_after_first']:.1f} | {m['rollout_s_mean']:.1f} | "
                  f"{m['train_s_mean']:.1f} | {m['push_s_mean']:.1f} | {m['engine_busy_frac']:.2f} | "
                  f"{m['trainer_idle_after_first']:.2f} | {m['trained_tokens_per_s']:.0f} |")
    print("\n| preset | mode | " + " | ".join(f"C={c}" for c in (16, 32, 64, 128)) + " (per engine): trained tok/s |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        for mode, sweep in r["concurrency_sweep"].items():
            print(f"| {name} | {mode} | "
                  + " | ".join(f"{v['trained_tokens_per_s']:.0f}" for v in sweep.values()) + " |")
    print("\n| preset | mode | max_staleness: trained tok/s (staleness seen) |")
    print("|---|---|---|")
    for name, r in results.items():
        for mode, sweep in r["staleness_sweep"].items():
            print(f"| {name} | {mode} | " + ", ".join(f"S={s}: {v['trained_tokens_per_s']:.0f} ({v['staleness_max']})"
                                                        for s, v in sweep.items()) + " |")
    print("\n| preset | train s/step | engine tok/s (TP) | formula engines | simulated engines "
          "| rollout wait / train time by engines |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        v = r["provisioning"]
        waits = ", ".join(f"{e}: {x['rollout_wait_frac']:.2f}" for e, x in v["sweep"].items())
        print(f"| {name} | {v['train_s']:.1f} | {v['engine_tokens_per_s']:.0f} (TP{v['engine_tp']}) | "
              f"{v['formula_engines']} | {v['simulated_engines']} | {waits} |")
    print("\n| preset | route | one weight sync, s, at 1 / 2 / 4 / 8 / 16 engines |")
    print("|---|---|---|")
    for name, r in results.items():
        for route, by_e in r["push_by_route"].items():
            print(f"| {name} | {route} | " + " / ".join(f"{s:.1f}" for s in by_e.values()) + " |")
    if a.anchors:
        an = out["anchors"]
        print(f"\nAReaL 1.5B: reported async/sync speedup {an['areal']['reported_speedup']:.2f}x, simulated "
              f"{an['areal']['simulated_speedup']:.2f}x")
        print(f"NeMo-Aligner 70B PPO: reported step {an['nemo_aligner_70b']['reported_step_s']:.0f} s, simulated "
              f"{an['nemo_aligner_70b']['simulated_step_s']:.0f} s")
    print(f"\nwrote {a.out} and {a.png} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
