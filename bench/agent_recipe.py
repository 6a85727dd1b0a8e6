#!/usr/bin/env python
"""Does the tiny agent recipe learn, seed after seed? Fresh runs of a recipe at its defaults.

    flock /tmp/megarl-heavy.lock .venv/bin/python bench/agent_recipe.py [--seeds 0 1 2] \
        [--recipe recipes/tiny_agent_cpu.yaml] [--window 10] [--out bench/out/agent_recipe.json] \
        [-- OVERRIDE ...]                         # about 2 min a run on 2 cores

Each seed is one `megarl train RECIPE checkpoint.resume=false run.seed=SEED` in a fresh run
directory (a temporary folder), one after the other; anything after `--` is passed on as extra
overrides to every run (to measure a candidate setting before it becomes the default). Per
run, from its metrics.jsonl (`reward_mean`: the trained episodes' environment reward, 64 a step
at the recipe's defaults):
- `first` / `last`: mean reward of the first and the last WINDOW steps; `rise` = last - first
  (the acceptance figure; WINDOW = 10 by default), and the same over 5 steps (`rise5`, the
  window bench/RESULTS.md uses for the countdown demo);
- `peak`: the highest WINDOW-step rolling mean and the step it ends at; `drop_from_peak` =
  peak - last (a reward that peaks and falls shows here);
- `approx_kl` (k3 of the step's old vs updated policy, averaged over the step's updates),
  `entropy` and `clip_frac` over the first and last WINDOW steps, and `kl` (to the reference)
  when the run has a reference (algo.kl_coef != 0);
- `zero_advantage_groups_frac` over the last WINDOW steps, `groups_trained`, the run's wall time.
The JSON holds every run and the mean / min / max over seeds of each figure.
"""
from __future__ import annotations

import argparse
import json
import statistics as st
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def window_mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return st.mean(values) if values else None


def summarize(rows: list[dict], window: int) -> dict:
    """The figures of one run's metrics rows (one per step), as the module docstring lists them."""
    rows = [r for r in rows if "reward_mean" in r]
    if len(rows) < 2 * window:
        raise ValueError(f"{len(rows)} steps: need at least 2 x window = {2 * window}")
    reward = [r["reward_mean"] for r in rows]
    rolling = [st.mean(reward[i - window:i]) for i in range(window, len(reward) + 1)]
    peak = max(rolling)
    first, last = st.mean(reward[:window]), st.mean(reward[-window:])
    out = {"steps": len(rows), "first": first, "last": last, "rise": last - first,
           "first5": st.mean(reward[:5]), "last5": st.mean(reward[-5:]),
           "rise5": st.mean(reward[-5:]) - st.mean(reward[:5]),
           "peak": peak, "peak_step": rows[rolling.index(peak) + window - 1]["step"], "drop_from_peak": peak - last,
           "groups_trained": sum(r.get("groups_trained", 0) for r in rows)}
    for key in ("approx_kl", "entropy", "clip_frac", "kl"):
        start, end = window_mean(rows[:window], key), window_mean(rows[-window:], key)
        if start is not None:
            out[f"{key}_first"], out[f"{key}_last"] = start, end
    out["zero_advantage_groups_frac_last"] = window_mean(rows[-window:], "zero_advantage_groups_frac")
    return out


def run_once(recipe: str, seed: int, overrides: list[str], run_dir: Path, window: int) -> dict:
    # sys.executable -m megarl.cli from ROOT: the checkout this file sits in, whatever is installed
    cmd = [sys.executable, "-m", "megarl.cli", "train", recipe, "checkpoint.resume=false", f"run.dir={run_dir}",
           f"run.seed={seed}", "metrics.tensorboard=false", *overrides]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"seed": seed, **summarize(rows, window), "wall_s": time.monotonic() - start}


def spread(runs: list[dict]) -> dict:
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float)) and k != "seed"]
    return {k: {"mean": st.mean(r[k] for r in runs), "min": min(r[k] for r in runs), "max": max(r[k] for r in runs)}
            for k in keys if all(r.get(k) is not None for r in runs)}


def main() -> int:
    argv = sys.argv[1:]
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="recipes/tiny_agent_cpu.yaml")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--window", type=int, default=10, help="steps per first / last window (default 10)")
    p.add_argument("--out", default="bench/out/agent_recipe.json")
    args = p.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="megarl_agent_recipe_") as tmp:
        for seed in args.seeds:
            runs.append(run_once(args.recipe, seed, overrides, Path(tmp) / f"seed_{seed}", args.window))
            r = runs[-1]
            print(f"seed {seed}: reward {r['first']:.3f} -> {r['last']:.3f} (rise {r['rise']:+.3f}, over 5 steps "
                  f"{r['rise5']:+.3f}), peak {r['peak']:.3f} at step {r['peak_step']}, approx_kl "
                  f"{r.get('approx_kl_first', float('nan')):.4f} -> {r.get('approx_kl_last', float('nan')):.4f}, "
                  f"entropy {r.get('entropy_first', float('nan')):.3f} -> {r.get('entropy_last', float('nan')):.3f}, "
                  f"{r['wall_s']:.0f} s", flush=True)
    out = {"recipe": args.recipe, "overrides": overrides, "window": args.window, "seeds": args.seeds,
           "runs": runs, "summary": spread(runs)}
    path = ROOT / args.out if not Path(args.out).is_absolute() else Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    s = out["summary"]
    print(f"rise over {len(runs)} seeds: mean {s['rise']['mean']:+.3f}, min {s['rise']['min']:+.3f}, "
          f"max {s['rise']['max']:+.3f}; last {s['last']['mean']:.3f}; drop from peak max "
          f"{s['drop_from_peak']['max']:.3f} -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
