#!/usr/bin/env python
"""DAPO against plain GRPO on the tiny countdown task, several seeds, at equal trained groups.

    .venv/bin/python bench/dapo_tiny.py [--seeds 0 1 2] [--steps 50] \
        [--out bench/out/dapo_tiny.json]          # about 70 s a run on 2 cores

Per seed, one after the other (the recipes interleaved, so a load that comes and goes falls on
both):
- `grpo`: recipes/tiny_dapo_cpu.yaml with DAPO's changes undone (no group filter, no overlong
  shaping, the symmetric clip): the tiny recipe under GRPO;
- `dapo`: recipes/tiny_dapo_cpu.yaml as it is (clip-higher, the zero_variance group filter,
  token-mean loss, overlong shaping).
Both train `train.groups_per_step` groups a step for the same steps (no elastic steps), so they
see equal trained groups, and both score the task's held-out prompts (256, 4 samples each at
temperature 1) before training and at the end. Per run, from its metrics.jsonl: that held-out
mean@4 at the start and the end; the trained groups' verifier reward (`reward_mean`, before any
shaping; under a filter it leaves out the groups the filter dropped) of the first and last five
steps; the share of trained groups with zero advantage (`zero_advantage_groups_frac`);
`prompts_drawn_per_trained_group`, `filtered_frac` and the summed step time. The JSON holds every
run and, per recipe, the mean and spread over seeds.
"""
from __future__ import annotations

import argparse
import json
import statistics as st
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEGARL = ROOT / ".venv" / "bin" / "megarl"
RECIPE = "recipes/tiny_dapo_cpu.yaml"
VARIANTS = {"grpo": ["rollout.group_filter=none", "reward.overlong_buffer=0", "algo.clip_high=0.2"],
            "dapo": []}
# both: one step trains exactly train.groups_per_step groups (no elastic steps), and the held-out
# prompts of the tiny task are scored before training and at the end, 4 samples each at the
# training temperature: the trained groups' reward is not comparable under a filter (it drops
# the groups every sample of which is right)
COMMON = ["rollout.partial.max_step_multiple=1", "eval.datasets=[artifacts/tiny_countdown/eval.jsonl]",
          "eval.n=4", "eval.temperature=1.0", "eval.k=[1]"]
EVAL = "eval/eval/mean@4"


def mean_of(rows: list[dict], key: str, default: float = float("nan")) -> float:
    values = [r[key] for r in rows if key in r]
    return st.mean(values) if values else default


def run_once(overrides: list[str], seed: int, steps: int, run_dir: Path) -> dict:
    cmd = [str(MEGARL), "train", RECIPE, "checkpoint.resume=false", f"run.dir={run_dir}", f"run.seed={seed}",
           "metrics.tensorboard=false", f"train.steps={steps}", *COMMON, *overrides]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r[EVAL] for r in rows if EVAL in r]
    rows = [r for r in rows if "reward_mean" in r]
    return {"eval_start": evals[0], "eval_end": evals[-1],
            "reward_first5": mean_of(rows[:5], "reward_mean"), "reward_last5": mean_of(rows[-5:], "reward_mean"),
            "zero_advantage_groups_frac": mean_of(rows, "zero_advantage_groups_frac"),
            "zero_advantage_groups_last10": mean_of(rows[-10:], "zero_advantage_groups_frac"),
            "prompts_drawn_per_trained_group": mean_of(rows, "prompts_drawn_per_trained_group", 1.0),
            "filtered_frac": mean_of(rows, "filtered_frac", 0.0),
            "groups_trained": sum(r.get("groups_trained", 0) for r in rows),
            "step_time_s": sum(r.get("step_time_s", 0.0) for r in rows)}


def spread(runs: list[dict]) -> dict:
    out = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        out[key] = {"mean": st.mean(values), "min": min(values), "max": max(values)}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", default="bench/out/dapo_tiny.json")
    args = p.parse_args()
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="megarl_dapo_") as tmp:
        for seed in args.seeds:
            for name, overrides in VARIANTS.items():
                runs.setdefault(name, []).append(run_once(overrides, seed, args.steps, Path(tmp) / f"{name}_{seed}"))
                print(name, seed, json.dumps(runs[name][-1]), flush=True)
    out = {"seeds": args.seeds, "steps": args.steps, "runs": runs, "summary": {k: spread(v) for k, v in runs.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    for name, s in out["summary"].items():
        print(f"{name}: held-out mean@4 {s['eval_start']['mean']:.3f} -> {s['eval_end']['mean']:.3f} "
              f"({s['eval_end']['min']:.3f}..{s['eval_end']['max']:.3f}); "
              f"trained reward {s['reward_first5']['mean']:.3f} -> {s['reward_last5']['mean']:.3f} "
              f"(last five steps over seeds {s['reward_last5']['min']:.3f}..{s['reward_last5']['max']:.3f}), "
              f"zero-advantage trained groups {s['zero_advantage_groups_frac']['mean']:.3f}, "
              f"prompts drawn per trained group {s['prompts_drawn_per_trained_group']['mean']:.2f}, "
              f"groups trained {s['groups_trained']['mean']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
