#!/usr/bin/env python
"""The tiny recipe at its defaults against the micro-batch rules it could use instead.

    .venv/bin/python bench/token_budget_default.py [--steps 50] [--repeats 2] \
        [--out bench/out/token_budget_default.json]     # about 70 s a run on 2 cores

Each variant is one `megarl train recipes/tiny_cpu.yaml` (seed 0, a fresh run, no TensorBoard),
run one after another, the variants interleaved `--repeats` times so a load that comes and goes
falls on all of them:
- `rows`: 16 rows per micro-batch (`train.micro_batch_size=16`), the recipe before the budget;
- `default`: the recipe as it is (the derived budget, config/schema/root.BUDGET_PER_CONTEXT);
- `budget_<n>`: an explicit `train.max_tokens_per_micro_batch=<n>` (--budgets).
Per run, from its metrics.jsonl: the mean `train_padding_frac`, the mean micro-batches per
update pass, the summed `train_time_s` and `step_time_s`, and the reward of the first and last
five steps. The JSON holds every run and, per variant, the means over its repeats, with each
time as a ratio to `rows` measured in the same invocation.
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


def variants(budgets: list[int]) -> dict[str, list[str]]:
    out = {"rows": ["train.micro_batch_size=16"], "default": []}
    out.update({f"budget_{b}": [f"train.max_tokens_per_micro_batch={b}"] for b in budgets})
    return out


def run_once(overrides: list[str], steps: int, run_dir: Path) -> dict:
    cmd = [str(MEGARL), "train", "recipes/tiny_cpu.yaml", "checkpoint.resume=false", f"run.dir={run_dir}",
           "metrics.tensorboard=false", f"train.steps={steps}", *overrides]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train_padding_frac" in r]
    return {"padding_frac": st.mean(r["train_padding_frac"] for r in rows),
            "micro_batches": st.mean(r["train_micro_batches"] for r in rows),
            "train_time_s": sum(r["train_time_s"] for r in rows),
            "step_time_s": sum(r["step_time_s"] for r in rows),
            "reward_first5": st.mean(r["reward_mean"] for r in rows[:5]),
            "reward_last5": st.mean(r["reward_mean"] for r in rows[-5:])}


def summary(runs: dict[str, list[dict]]) -> dict:
    means = {v: {k: st.mean(r[k] for r in rs) for k in rs[0]} for v, rs in runs.items()}
    for m in means.values():
        for k in ("train_time_s", "step_time_s"):
            m[f"{k}_vs_rows"] = m[k] / means["rows"][k]
    return means


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--budgets", type=int, nargs="*", default=[256, 1024])
    p.add_argument("--out", default="bench/out/token_budget_default.json")
    args = p.parse_args()
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="megarl_budget_") as tmp:
        for i in range(args.repeats):
            for name, overrides in variants(args.budgets).items():
                runs.setdefault(name, []).append(run_once(overrides, args.steps, Path(tmp) / f"{name}_{i}"))
                print(name, i, json.dumps(runs[name][-1]), flush=True)
    out = {"steps": args.steps, "repeats": args.repeats, "runs": runs, "means": summary(runs)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    for name, m in out["means"].items():
        print(f"{name:>12}: padding {m['padding_frac']:.3f}, micro-batches {m['micro_batches']:.1f}, "
              f"train {m['train_time_s']:.1f} s ({m['train_time_s_vs_rows']:.2f}x rows), "
              f"step {m['step_time_s']:.1f} s ({m['step_time_s_vs_rows']:.2f}x rows), "
              f"reward {m['reward_first5']:.3f} -> {m['reward_last5']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
