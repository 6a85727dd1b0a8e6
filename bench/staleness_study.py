#!/usr/bin/env python
"""Training on stale data: plain PPO clipping vs M2PO, BAPO and gradient-alignment control at a
fixed lag (issue 21), on the tiny countdown task on CPU.

    .venv/bin/python bench/staleness_study.py [--grid default|full] [--steps N] [--algos grpo ppo]
        [--lags 0 1 2 4 8 16] [--methods plain m2po bapo gac] [--seeds 0 1 2] [--resume]
        [--out bench/out] [--time-budget-min M] [--dry-run] [-- extra overrides ...]
    .venv/bin/python bench/staleness_study.py --table  [--out DIR]   # the markdown table, from the JSON
    .venv/bin/python bench/staleness_study.py --replot [--out DIR]   # redraw the PNG, from the JSON

What it does
- One vLLM server on the tiny model (megarl.rollout.engines.servers.LocalServer, as tests/conftest.py's
  remote_engine) serves every run; each run pushes its own starting weights first, so runs
  need nothing reset between them.
- Each run is `python -m megarl.cli train recipes/tiny_cpu.yaml ...` in a fresh process
  (megatron's CPU shim and vLLM change process-wide state) with rollout.mode=sync and
  rollout.lag=K: step s trains on the round generated K weight versions earlier (the first K+1
  rounds come from the starting weights), so staleness is held fixed instead of depending on
  timing. Every run trains the same samples: --steps x --groups-per-step x rollout.sampling.n.
- Methods (every one of them logs grad_cosine, so the cosine of consecutive gradients is
  comparable across methods; `log` changes nothing in the update):
    plain  PPO ratio clipping only (algo.grad_align=log)
    m2po   algo.m2po_tau=--m2po-tau (M2PO: second-moment mask instead of the ratio clip)
    bapo   algo.bapo=true (BAPO: adaptive clip bounds, the paper's defaults)
    gac    algo.grad_align=project, threshold --gac-threshold (gradient-alignment control)
- After each run its final policy is sampled on the shared server (the run's last push left
  its weights there): --eval-prompts fixed prompts x --eval-n samples, fixed request seeds, the
  recipe's temperature and token budget (`Evaluator`). That is the reward compared across lags:
  a step's reward_mean is the reward of the round it trained, which a lagged run generated K
  versions earlier, so its last steps show a policy K updates old.
- Runs go one after another (2 cores: two at once would only share them). The JSON is written
  after every run, so an interrupted study keeps what it measured; --resume skips the runs the
  JSON holds as finished (failed ones are tried again).
- --grid default is the issue's grid cut to fit one hour on 2 cores (see `default_grid`);
  --grid full is the whole grid (2 x 6 x 4 x 3 = 144 runs, hours). --lags, --methods, --algos
  and --seeds narrow either. Before each run the remaining time budget is checked against the
  run's predicted time (measured costs, `predict_run_s`); runs that would overrun it are
  recorded as skipped, lowest-priority runs last in the order, so they are the ones dropped.
- Writes <out>/staleness_study.json (settings, per run: overrides, wall time, per-step
  metrics), <out>/staleness_study.png (reward curves by lag per method and algorithm; final
  reward vs K) and prints a markdown table per (algo, method, K).

Why these settings: train.groups_per_step=8 (half the recipe's 16) halves the cost of a step so
the grid fits; train.actor_lr=3e-4 (3x the recipe's) lets GRPO reach its plateau (reward ~0.85)
in ~10 steps, so the policy moves far enough that data K versions old differs from the current
one; 24 steps leave a K=16 run 8 steps at full lag after its 17 steps on the starting
weights' rounds, and the default grid's 49 runs a predicted ~46 minutes (`describe`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/tiny_cpu.yaml"
JSON_NAME = "staleness_study.json"
PNG_NAME = "staleness_study.png"

ALGOS = ("grpo", "ppo")
LAGS = (0, 1, 2, 4, 8, 16)
METHODS = ("plain", "m2po", "bapo", "gac")
SEEDS = (0, 1, 2)

# Per-step metrics kept in the JSON: the ones named here plus any whose name starts with one of
# PREFIXES (the stabilizers' own figures, whatever they are called in detail).
KEEP = ("reward_mean", "kl", "approx_kl", "entropy", "is_weight_mean", "is_weight_max", "is_masked_frac",
        "clip_frac", "ratio_mean", "staleness_mean", "staleness_max", "grad_cosine", "grad_norm",
        "policy_loss", "value_loss", "response_len_mean", "samples", "train_time_s", "step_time_s", "rollout_time_s")
PREFIXES = ("m2po_", "bapo_", "grad_align", "grad_cos")

# Measured on the 2-core CPU machine, the server shared, other jobs loading the cores (load
# average 3-8; the server started in 53 s idle, 100-136 s loaded): a run costs process start +
# megatron build + first weight push + the final-policy sample (FIXED_S), then per trained step
# a round + update + push (STEP_S; 24-step runs: GRPO 46 s, PPO 74 s), plus the K extra rounds
# a lag generates at the start (ROUND_S each; GRPO K=16: 51 s). PPO's step also trains the critic.
SERVER_START_S = 90.0
FIXED_S = 22.0
STEP_S = {"grpo": 1.05, "ppo": 2.1}
ROUND_S = 0.35


# -- the grid ----------------------------------------------------------------------------
def run_key(algo: str, method: str, lag: int, seed: int) -> str:
    return f"{algo}-{method}-K{lag}-s{seed}"


def full_grid(algos, lags, methods, seeds) -> list[dict]:
    """Every combination, seed-major (all of seed 0 first: the most useful part comes first)."""
    return [{"algo": a, "method": m, "lag": k, "seed": s}
            for s in seeds for a in algos for m in methods for k in lags]


def default_grid(algos, lags, methods, seeds) -> list[dict]:
    """The issue's grid cut to fit about 50 minutes, in priority order:
    1. the first of `algos` (GRPO by default): every lag x every method, first seed;
    2. the other algorithms (PPO): every lag plain, and each stabilizer at the largest lag, first seed;
    3. the other seeds: the first algorithm, every method, at the smallest and largest lag
       (the two ends of the curve: what the seed spread is where it matters most).
    What this leaves out of full_grid is listed by `cut_summary`."""
    first, rest_algos = algos[0], list(algos[1:])
    seed0, rest_seeds = seeds[0], list(seeds[1:])
    lo, hi = min(lags), max(lags)
    plan = [{"algo": first, "method": m, "lag": k, "seed": seed0} for k in lags for m in methods]
    for a in rest_algos:
        plan += [{"algo": a, "method": "plain", "lag": k, "seed": seed0} for k in lags if "plain" in methods]
        plan += [{"algo": a, "method": m, "lag": hi, "seed": seed0} for m in methods if m != "plain"]
    for s in rest_seeds:
        plan += [{"algo": first, "method": m, "lag": k, "seed": s} for k in sorted({lo, hi}) for m in methods]
    return plan


def cut_summary(full: list[dict], chosen: list[dict]) -> dict:
    """What the chosen grid leaves out of the full one, grouped by (algo, method, seed): the lags cut."""
    keep = {run_key(**r) for r in chosen}
    cut: dict[str, list[int]] = {}
    for r in full:
        if run_key(**r) not in keep:
            cut.setdefault(f"{r['algo']} {r['method']} seed {r['seed']}", []).append(r["lag"])
    return {"runs_full": len(full), "runs_chosen": len(chosen), "runs_cut": len(full) - len(chosen),
            "cut_lags": {k: sorted(v) for k, v in cut.items()}}


def predict_run_s(run: dict, steps: int) -> float:
    """A run's wall time from the measured costs above (the server's start is not in it)."""
    return FIXED_S + steps * STEP_S.get(run["algo"], max(STEP_S.values())) + run["lag"] * ROUND_S


# -- one run -----------------------------------------------------------------------------
def method_overrides(method: str, m2po_tau: float, gac_threshold: float) -> list[str]:
    table = {
        "plain": ["algo.grad_align=log"],
        "m2po": [f"algo.m2po_tau={m2po_tau}", "algo.grad_align=log"],
        "bapo": ["algo.bapo=true", "algo.grad_align=log"],
        "gac": ["algo.grad_align=project", f"algo.grad_align_threshold={gac_threshold}"],
    }
    if method not in table:
        raise SystemExit(f"--methods {method!r}: expected some of {', '.join(table)}")
    return table[method]


def run_overrides(run: dict, settings: dict, run_dir: Path, url: str) -> list[str]:
    model = settings["model"]
    return [f"model.path={model}", f"data.prompts={model}/prompts.jsonl",
            f"algo.name={run['algo']}", *method_overrides(run["method"], settings["m2po_tau"],
                                                          settings["gac_threshold"]),
            "rollout.mode=sync", f"rollout.lag={run['lag']}",
            f"train.steps={settings['steps']}", f"train.groups_per_step={settings['groups_per_step']}",
            f"train.actor_lr={settings['actor_lr']}",
            f"run.dir={run_dir}", f"run.seed={run['seed']}", f"run.name=staleness-{run_key(**run)}",
            # checkpoint.every=0 leaves only the end-of-run save; resume=false: never pick one up
            "checkpoint.every=0", "checkpoint.resume=false",
            "metrics.tensorboard=false", "metrics.progress=false",
            "rollout.engines.mode=remote", f"rollout.engines.urls=[{url}]", *settings["extra"]]


def read_metrics(path: Path) -> dict[str, list]:
    """metrics.jsonl -> {name: per-step values} for the names worth keeping (None where a step
    lacks it)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    names = sorted({k for r in rows for k in r if k in KEEP or k.startswith(PREFIXES)})
    return {"step": [r.get("step") for r in rows], **{n: [r.get(n) for r in rows] for n in names}}


class Evaluator:
    """The reward of the policy a run ended with, on one fixed set of prompts and request seeds
    (the same for every run: common sampling noise, so differences between runs are the
    policies'). Why: the step's reward_mean is the reward of the round it trained, generated K
    versions earlier, so a lagged run's last steps show a policy K updates old and the final
    one is never seen. The run's last weight push leaves its final weights on the shared
    server: sampled here right after the run, at the recipe's temperature and token budget."""

    def __init__(self, model: Path, url: str, api_key: str, prompts: int, n: int):
        from transformers import AutoTokenizer

        from megarl.config import load_config
        from megarl.data.prompts import encode_prompts, load_prompts
        from megarl.rewards import get_reward_fn

        cfg = load_config(ROOT / RECIPE, [f"model.path={model}", f"data.prompts={model}/prompts.jsonl"])
        records = load_prompts(cfg.data.prompts, cfg.data.prompt_key)
        self.records = list(records)[-prompts:]      # the file's last prompts: one fixed set for every run
        self.tokenizer = AutoTokenizer.from_pretrained(str(model))
        self.prompt_ids = encode_prompts(self.tokenizer, self.records, cfg.data.prompt_key)
        self.reward_fn = get_reward_fn(cfg.reward.fn)
        self.url, self.api_key, self.n = url, api_key, n
        self.max_tokens, self.temperature = cfg.rollout.sampling.max_new_tokens, cfg.rollout.sampling.temperature

    async def _sample(self):
        from megarl.rollout.engines.engine import GenRequest
        from megarl.rollout.engines.vllm_http import HTTPVLLMEngine

        engine = HTTPVLLMEngine("eval", self.url, self.api_key, timeout_s=300)
        await engine.start()
        try:
            # the version the run's last push labelled the weights with (the server reports it)
            _, info = await engine._call("GET", "/weight_info", check=False)
            reqs = [GenRequest(f"eval-{i}-{j}", ids, self.max_tokens, self.temperature, seed=10_000 + self.n * i + j)
                    for i, ids in enumerate(self.prompt_ids) for j in range(self.n)]
            return info, await asyncio.gather(*(engine.generate(r) for r in reqs))
        finally:
            await engine.close()

    def __call__(self) -> dict:
        t0 = time.perf_counter()
        info, results = asyncio.run(self._sample())
        rewards = [float(self.reward_fn(self.tokenizer.decode(r.token_ids, skip_special_tokens=True),
                                        self.records[i // self.n], finished=r.finish_reason == "stop"))
                   for i, r in enumerate(results)]
        return {"eval_reward": sum(rewards) / len(rewards), "eval_samples": len(rewards),
                "eval_weight_info": info,
                "eval_response_len": sum(len(r.token_ids) for r in results) / len(results),
                "eval_s": time.perf_counter() - t0}


def served_version(info) -> int | None:
    """The weight version in the server's GET /weight_info answer, if it names one."""
    if not isinstance(info, dict):
        return None
    for key in ("weight_version", "version"):
        try:
            return int(info[key])
        except (KeyError, TypeError, ValueError):
            continue
    return None


def execute(run: dict, settings: dict, out: Path, url: str, env: dict, timeout_s: float,
            evaluate=None) -> dict:
    """One training run in a fresh process; its record for the JSON (status ok | failed)."""
    run_dir = out / "runs" / run_key(**run)
    shutil.rmtree(run_dir, ignore_errors=True)       # a fresh run: no rows or checkpoints of an old one
    over = run_overrides(run, settings, run_dir, url)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "megarl.cli", "train", RECIPE, *over], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout_s)
        rc, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:
        caught = exc.stderr or ""      # bytes on some Pythons even with text=True
        rc, err = "timeout", caught.decode(errors="replace") if isinstance(caught, bytes) else caught
    wall = time.perf_counter() - t0
    metrics = read_metrics(run_dir / "metrics.jsonl")
    done = rc == 0 and len(metrics["step"]) == settings["steps"]
    (run_dir / "stderr.log").parent.mkdir(parents=True, exist_ok=True)
    (run_dir / "stderr.log").write_text(err or "")
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)    # megabytes per run, never read again
    record = {**run, "key": run_key(**run), "status": "ok" if done else "failed", "returncode": rc,
              "wall_s": wall, "predicted_s": predict_run_s(run, settings["steps"]), "overrides": over,
              "metrics": metrics}
    if not done:
        record["stderr_tail"] = (err or "")[-3000:]
    elif evaluate is not None:
        try:
            record["eval"] = evaluate()
        except Exception as exc:  # noqa: BLE001 - the run's own metrics still count
            record["eval"] = {"error": f"{type(exc).__name__}: {exc}"}
        served = served_version(record["eval"].get("eval_weight_info"))
        if served is not None and served != settings["steps"]:
            record["warning"] = (f"the final-policy sample ran on weight version {served}, not the run's last "
                                 f"({settings['steps']}): its eval_reward is not the final policy's")
    if done and run["lag"] > 0 and not any(v for v in metrics.get("staleness_mean", []) if v):
        record["warning"] = (f"rollout.lag={run['lag']} but staleness_mean is 0 in every step: "
                             "the lag had no effect in this run")
    return record


# -- the JSON ----------------------------------------------------------------------------
COMPARED = ("steps", "groups_per_step", "actor_lr", "m2po_tau", "gac_threshold", "extra", "recipe",
            "eval_prompts", "eval_n")


def load_result(path: Path) -> dict:
    if not path.exists():
        raise SystemExit(f"{path}: no study JSON there (run the study first, or pass --out DIR of one)")
    return json.loads(path.read_text())


def check_resumable(old: dict, settings: dict) -> None:
    """--resume mixes runs of two invocations: only allowed when they trained alike."""
    diff = {k: (old["settings"].get(k), settings[k]) for k in COMPARED if old["settings"].get(k) != settings[k]}
    if diff:
        detail = ", ".join(f"{k}: {a!r} in the JSON vs {b!r} now" for k, (a, b) in diff.items())
        raise SystemExit(f"--resume: the JSON's runs were trained with other settings ({detail}); pass the same "
                         "flags, or a new --out to start another study")


def write_json(path: Path, result: dict) -> None:
    """Write through a temporary file: an interrupt mid-write leaves the previous JSON intact."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)


# -- summaries ---------------------------------------------------------------------------
def _vals(xs) -> list[float]:
    return [float(x) for x in xs or [] if x is not None and math.isfinite(float(x))]


def _mean(xs) -> float | None:
    v = _vals(xs)
    return sum(v) / len(v) if v else None


def window(steps: int) -> int:
    """Steps averaged for 'final' and 'first': 5, fewer on runs too short for two windows."""
    return max(1, min(5, steps // 2))


def run_summary(metrics: dict, evaluation: dict | None = None) -> dict:
    """One run's figures: final reward (mean of the last window), rise (last minus first window),
    mean reward over all steps, and the run's KL / entropy (last window), IS and mask statistics."""
    r = _vals(metrics.get("reward_mean"))
    w = window(len(r))

    def last(name):
        return _mean(_vals(metrics.get(name))[-w:])

    def worst(name):
        v = _vals(metrics.get(name))
        return max(v) if v else None
    final = _mean(r[-w:])
    first = _mean(r[:w])
    return {"eval_reward": (evaluation or {}).get("eval_reward"),
            "final_reward": final, "reward_rise": None if final is None else final - first,
            "mean_reward": _mean(r), "kl": last("kl"), "approx_kl": _mean(metrics.get("approx_kl")),
            "entropy": last("entropy"),
            "is_weight_mean": _mean(metrics.get("is_weight_mean")), "is_weight_max": worst("is_weight_max"),
            "is_masked_frac": _mean(metrics.get("is_masked_frac")), "clip_frac": _mean(metrics.get("clip_frac")),
            "m2po_masked_frac": _mean(metrics.get("m2po_masked_frac")),
            "grad_cosine": _mean(metrics.get("grad_cosine")),
            "grad_align_corrected_frac": _mean(metrics.get("grad_align_corrected_frac")),
            "staleness_mean": _mean(metrics.get("staleness_mean"))}


def mean_spread(xs) -> tuple[float | None, float | None]:
    """Mean over seeds and the sample standard deviation (None with one seed)."""
    v = _vals(xs)
    if not v:
        return None, None
    m = sum(v) / len(v)
    if len(v) < 2:
        return m, None
    return m, math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1))


def cells(result: dict) -> dict[tuple, list[dict]]:
    """(algo, method, lag) -> the run summaries of its finished seeds."""
    out: dict[tuple, list[dict]] = {}
    for rec in result["runs"].values():
        if rec["status"] == "ok":
            out.setdefault((rec["algo"], rec["method"], rec["lag"]), []).append(
                run_summary(rec["metrics"], rec.get("eval")))
    return out


def _order(key: tuple) -> tuple:
    algo, method, lag = key
    return (ALGOS.index(algo) if algo in ALGOS else 99, algo,
            METHODS.index(method) if method in METHODS else 99, method, lag)


TABLE_COLUMNS = [("eval_reward", "final policy"), ("final_reward", "final reward"), ("reward_rise", "rise"),
                 ("mean_reward", "mean reward"),
                 ("kl", "KL ref"), ("approx_kl", "KL old"), ("entropy", "entropy"), ("is_weight_mean", "IS w mean"),
                 ("is_weight_max", "IS w max"), ("is_masked_frac", "IS masked"), ("clip_frac", "clipped"),
                 ("m2po_masked_frac", "M2PO masked"), ("grad_cosine", "grad cos"),
                 ("grad_align_corrected_frac", "GAC corrected"), ("staleness_mean", "staleness")]


SPREAD = ("eval_reward", "final_reward")


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(result: dict) -> str:
    """Markdown: one row per (algo, method, K); the rewards as mean +- std over seeds, the other
    columns as means over seeds."""
    steps = result["settings"]["steps"]
    w = window(steps)
    head = ["algo", "method", "K", "seeds"] + [label for _, label in TABLE_COLUMNS]
    per_step = next((r["metrics"].get("samples", [None])[0] for r in result["runs"].values() if r["status"] == "ok"),
                    None)
    lines = [f"{steps} steps x {per_step or '?'} samples ({result['settings']['groups_per_step']} groups) per run; "
             "final policy = reward of the weights the run ended with, sampled on fixed prompts after the run "
             f"(+- std over seeds); final reward = mean reward of the rounds trained in the last {w} steps "
             f"(generated K versions earlier; +- std over seeds), rise = last {w} minus first {w}; KL ref (to "
             f"the reference) and entropy over the last {w} steps; KL old (approx_kl: the updated policy vs the "
             "one that generated the data), IS / mask / cosine figures averaged over the run (IS w max: the "
             "run's largest).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    summary = cells(result)
    for key in sorted(summary, key=_order):
        runs = summary[key]
        row = [key[0], key[1], str(key[2]), str(len(runs))]
        for name, _ in TABLE_COLUMNS:
            m, sd = mean_spread([r[name] for r in runs])
            row.append(_fmt(m) + (f" +- {sd:.3f}" if name in SPREAD and sd is not None else ""))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def headline_key(summary: dict[tuple, list[dict]]) -> str:
    """The reward that compares lags: the final policy's (eval_reward) where every run sampled
    it, else the trained rounds' last steps (final_reward, K versions behind in a lagged run)."""
    every = all(r["eval_reward"] is not None for runs in summary.values() for r in runs)
    return "eval_reward" if every and summary else "final_reward"


def envelope(result: dict, tolerance: float) -> list[str]:
    """Per (algo, method): the largest K whose reward (headline_key) stays within `tolerance` of
    the same method's K=0 (the smallest lag run), every smaller K included: a reading aid for the
    table, not a significance test."""
    by: dict[tuple, dict[int, float]] = {}
    summary = cells(result)
    key = headline_key(summary)
    label = "final-policy reward" if key == "eval_reward" else "final reward"
    for (algo, method, lag), runs in summary.items():
        m, _ = mean_spread([r[key] for r in runs])
        if m is not None:
            by.setdefault((algo, method), {})[lag] = m
    out = []
    for (algo, method), curve in sorted(by.items(), key=lambda kv: _order((*kv[0], 0))):
        lags = sorted(curve)
        if len(lags) < 2:
            continue
        base, held = curve[lags[0]], lags[0]
        for k in lags[1:]:
            if curve[k] < base - tolerance:
                break
            held = k
        broke = next((k for k in lags if curve[k] < base - tolerance), None)
        out.append(f"{algo} {method}: {label} {base:.3f} at K={lags[0]}; within {tolerance} of it up to "
                   f"K={held}" + (f", below from K={broke} ({curve[broke]:.3f})" if broke is not None
                                  else f" (every lag measured, up to K={lags[-1]})"))
    return out


# -- the figure --------------------------------------------------------------------------
def trailing_mean(xs: list[float], n: int) -> list[float]:
    """Mean of each value and the n - 1 before it (fewer at the start): a step's reward is
    the mean of one round's samples only, too noisy to tell curves apart."""
    return [sum(xs[max(0, i - n + 1): i + 1]) / (i + 1 - max(0, i - n + 1)) for i in range(len(xs))]


def plot(result: dict, png: Path, smooth: int = 3) -> None:
    """Rows: algorithms; columns: one reward-vs-step panel per method (a line per lag, mean
    over seeds, trailing mean of `smooth` steps) and the final reward vs K (a line per method,
    std over seeds as bars)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"].values() if r["status"] == "ok"]
    if not runs:
        raise SystemExit(f"{png}: nothing to plot, the JSON holds no finished run")
    algos = sorted({r["algo"] for r in runs}, key=lambda a: (ALGOS.index(a) if a in ALGOS else 99, a))
    methods = sorted({r["method"] for r in runs}, key=lambda m: (METHODS.index(m) if m in METHODS else 99, m))
    lags = sorted({r["lag"] for r in runs})
    cmap = plt.get_cmap("viridis")
    colour = {k: cmap(i / max(1, len(lags) - 1)) for i, k in enumerate(lags)}
    fig, axes = plt.subplots(len(algos), len(methods) + 1, figsize=(3.4 * (len(methods) + 1), 2.9 * len(algos)),
                             squeeze=False, sharey=True)
    summary = cells(result)
    headline = headline_key(summary)
    for i, algo in enumerate(algos):
        for j, method in enumerate(methods):
            ax = axes[i][j]
            for k in lags:
                curves = [_vals(r["metrics"].get("reward_mean")) for r in runs
                          if (r["algo"], r["method"], r["lag"]) == (algo, method, k)]
                if not curves:
                    continue
                n = min(len(c) for c in curves)
                mean = trailing_mean([sum(c[t] for c in curves) / len(curves) for t in range(n)], smooth)
                ax.plot(range(n), mean, color=colour[k], lw=1.2, label=f"K={k}" + (f" ({len(curves)})"
                                                                                   if len(curves) > 1 else ""))
            ax.set_title(f"{algo} {method}", fontsize=9)
            ax.set_xlabel("step (reward of the round it trained)", fontsize=8)
            if j == 0:
                ax.set_ylabel("reward_mean", fontsize=8)
            if ax.lines:
                ax.legend(fontsize=6, loc="lower right")
            ax.grid(alpha=0.3)
        ax = axes[i][-1]
        for j, method in enumerate(methods):
            ks = [k for k in lags if (algo, method, k) in summary]
            shift = 0.06 * (j - (len(methods) - 1) / 2)   # side by side: equal points stay visible
            stats = [mean_spread([r[headline] for r in summary[(algo, method, k)]]) for k in ks]
            if not ks:
                continue
            ax.errorbar([lags.index(k) + shift for k in ks], [m for m, _ in stats], yerr=[sd or 0.0 for _, sd in stats],
                        marker="o", ms=3, capsize=2, lw=1.2, label=method)
        ax.set_xticks(range(len(lags)), [str(k) for k in lags])
        ax.set_title(f"{algo}: {'final policy' if headline == 'eval_reward' else 'final'} reward vs lag K",
                     fontsize=9)
        ax.set_xlabel("K (rounds of lag)", fontsize=8)
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    s = result["settings"]
    fig.suptitle(f"staleness study, tiny countdown: {s['steps']} steps x {s['groups_per_step']} groups, "
                 f"actor_lr {s['actor_lr']}\nreward: mean over seeds (their number in parentheses where > 1)"
                 + (f", trailing mean of {smooth} steps" if smooth > 1 else ""), fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


# -- main --------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", choices=("default", "full"), default="default",
                   help="default: the cut grid that fits about 50 minutes (default_grid); full: every combination")
    p.add_argument("--steps", type=int, default=24, help="trained steps per run (the same in every run)")
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--actor-lr", type=float, default=3e-4)
    p.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS,
                   help="the first gets the whole lag x method grid under --grid default")
    p.add_argument("--lags", nargs="+", type=int, default=list(LAGS))
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS),
                   help="the first is the main seed; under --grid default the others run at the extreme lags")
    p.add_argument("--m2po-tau", type=float, default=0.04, help="algo.m2po_tau of method m2po (the paper's 0.04)")
    p.add_argument("--gac-threshold", type=float, default=0.3, help="algo.grad_align_threshold of method gac")
    p.add_argument("--out", default="bench/out", help="folder of the JSON, the PNG and runs/<key>/")
    p.add_argument("--model", default="artifacts/tiny_countdown")
    p.add_argument("--resume", action="store_true", help="skip the runs the JSON in --out holds as finished")
    p.add_argument("--time-budget-min", type=float, default=None,
                   help="skip runs whose predicted time no longer fits, counting from the start "
                        "(default: 57 with --grid default, none with --grid full; 0: none)")
    p.add_argument("--run-timeout-s", type=float, default=900, help="a run taking longer is stopped and failed")
    p.add_argument("--tolerance", type=float, default=0.1,
                   help="envelope lines: a lag 'holds' while its final reward is within this of K=0's")
    p.add_argument("--smooth", type=int, default=3, help="PNG: trailing mean of this many steps (1: raw)")
    p.add_argument("--eval-prompts", type=int, default=64,
                   help="after each run, sample its final policy on this many fixed prompts (0: skip)")
    p.add_argument("--eval-n", type=int, default=2, help="samples per evaluation prompt")
    p.add_argument("--dry-run", action="store_true", help="print the grid and its predicted time, run nothing")
    p.add_argument("--table", action="store_true", help="print the table from the JSON in --out, then exit")
    p.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON in --out, then exit")
    p.add_argument("extra", nargs="*", help="more overrides for every run, after `--` (e.g. -- algo.is_cap=5)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps {args.steps}: must be >= 1")
    if min(args.lags) < 0:
        p.error(f"--lags {args.lags}: lags are >= 0 (0: no staleness)")
    for name in ("lags", "seeds", "algos", "methods"):     # dedupe, keep the order given
        setattr(args, name, list(dict.fromkeys(getattr(args, name))))
    if args.time_budget_min is None:
        args.time_budget_min = 57.0 if args.grid == "default" else 0.0
    return args


def plan_runs(args) -> tuple[list[dict], dict]:
    full = full_grid(args.algos, args.lags, args.methods, args.seeds)
    chosen = full if args.grid == "full" else default_grid(args.algos, args.lags, args.methods, args.seeds)
    return chosen, cut_summary(full, chosen)


def describe(chosen: list[dict], cut: dict, steps: int) -> str:
    total = SERVER_START_S + sum(predict_run_s(r, steps) for r in chosen)
    lines = [f"grid: {cut['runs_chosen']} runs of {cut['runs_full']} ({cut['runs_cut']} cut), {steps} steps each; "
             f"predicted {total / 60:.1f} min (server start {SERVER_START_S:.0f} s + per run {FIXED_S:.0f} s "
             f"+ {STEP_S} s/step + {ROUND_S} s per lag round)"]
    for name, ks in cut["cut_lags"].items():
        lines.append(f"  cut: {name}: K in {ks}")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    out = (ROOT / args.out) if not Path(args.out).is_absolute() else Path(args.out)
    json_path, png_path = out / JSON_NAME, out / PNG_NAME
    if args.table or args.replot:
        result = load_result(json_path)
        if args.replot:
            plot(result, png_path, args.smooth)
            print(f"wrote {png_path}")
        if args.table:
            print(table(result))
            print("\n".join(envelope(result, args.tolerance)))
        return

    chosen, cut = plan_runs(args)
    print(describe(chosen, cut, args.steps), flush=True)
    if args.dry_run:
        return
    model = (ROOT / args.model) if not Path(args.model).is_absolute() else Path(args.model)
    if not (model / "model.safetensors").exists():
        subprocess.run([sys.executable, str(ROOT / "tools/make_tiny_model.py"), "--out", str(model)],
                       check=True, cwd=ROOT)
    settings = {"recipe": RECIPE, "model": str(model), "steps": args.steps, "groups_per_step": args.groups_per_step,
                "actor_lr": args.actor_lr, "m2po_tau": args.m2po_tau, "gac_threshold": args.gac_threshold,
                "extra": list(args.extra), "eval_prompts": args.eval_prompts, "eval_n": args.eval_n}
    result = {"settings": settings, "runs": {}}
    if args.resume and json_path.exists():
        result = load_result(json_path)
        check_resumable(result, settings)
    result.update(grid=args.grid, algos=args.algos, lags=args.lags, methods=args.methods, seeds=args.seeds,
                  planned=[run_key(**r) for r in chosen], cut=cut, skipped_for_time=[],
                  machine={"cpus": os.cpu_count(), "load_avg_at_start": os.getloadavg()})
    todo = [r for r in chosen if result["runs"].get(run_key(**r), {}).get("status") != "ok"]
    if len(todo) < len(chosen):
        print(f"--resume: {len(chosen) - len(todo)} runs already in {json_path}, {len(todo)} to go", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    t_begin = time.perf_counter()
    budget_s = args.time_budget_min * 60
    # imported here: --table, --replot and --dry-run need neither torch nor vLLM
    from megarl.rollout.engines.servers import LocalServer

    server = LocalServer(model, out / "engine_0.log", api_key=secrets.token_hex(16), seed=0, max_model_len=256,
                         kv_cache_mb=64, weight_backend="gloo")
    try:
        if todo:
            server.start()
            server.wait_healthy(600)
        result["engine_start_s"] = time.perf_counter() - t_begin
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "MEGARL_ENGINE_API_KEY": server.api_key}
        evaluate = (Evaluator(model, server.url, server.api_key, args.eval_prompts, args.eval_n)
                    if todo and args.eval_prompts else None)
        for i, run in enumerate(todo):
            elapsed = time.perf_counter() - t_begin
            predicted = predict_run_s(run, args.steps)
            if budget_s and elapsed + predicted > budget_s:
                result["skipped_for_time"].append(run_key(**run))
                continue
            rec = execute(run, settings, out, server.url, env, args.run_timeout_s, evaluate)
            result["runs"][rec["key"]] = rec
            result["study_wall_s"] = time.perf_counter() - t_begin
            write_json(json_path, result)
            s = run_summary(rec["metrics"], rec.get("eval"))
            print(f"[{i + 1}/{len(todo)}] {rec['key']}: {rec['status']} in {rec['wall_s']:.0f} s "
                  f"(predicted {predicted:.0f}); final policy {_fmt(s['eval_reward'])}, final reward "
                  f"{_fmt(s['final_reward'])}, staleness "
                  f"{_fmt(s['staleness_mean'], 2)}" + (f"; {rec['warning']}" if "warning" in rec else "")
                  + (f"\n{rec['stderr_tail'][-1500:]}" if rec["status"] != "ok" else ""), flush=True)
    finally:
        server.stop()
        result["study_wall_s"] = time.perf_counter() - t_begin
        result["machine"]["load_avg_at_end"] = os.getloadavg()
        write_json(json_path, result)
    if result["skipped_for_time"]:
        print(f"skipped for the time budget ({args.time_budget_min} min): {', '.join(result['skipped_for_time'])}")
    wrote = [json_path]
    if any(r["status"] == "ok" for r in result["runs"].values()):
        plot(result, png_path, args.smooth)
        wrote.append(png_path)
        print(table(result))
        print("\n".join(envelope(result, args.tolerance)))
    failed = [k for k, r in result["runs"].items() if r["status"] != "ok"]
    print(f"wrote {' and '.join(map(str, wrote))} in {result['study_wall_s'] / 60:.1f} min"
          + (f"; failed: {', '.join(failed)}" if failed else ""))


if __name__ == "__main__":
    main()
