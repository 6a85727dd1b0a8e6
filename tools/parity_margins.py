"""How far each tolerance of the layout parity tests (tests/dist/parity.py) sits from this
machine's fp32 noise and from the smallest real errors it must catch.

Runs tests/dist/layout_probe.py (3 PPO steps of the tiny model, as tests/dist/test_layouts.py
does): the single-rank reference; the reference again in other reduction orders (2 threads,
micro-batches of 1 and 2 rows, and in launches of their own MKL's generic code path,
MKL_CBWR=COMPATIBLE, and ATen without AVX, ATEN_CPU_CAPABILITY=default: stand-ins for another
processor's path through the libraries); the layouts TP=2, PP=2 and DP=2; and real errors
(actor_lr and critic_lr x1.01, two rows of one TP shard swapped at TP=2). Prints per quantity,
in units of its tolerance: the largest noise and what gave it, the margin (tolerance / noise,
the suite wants >= parity.NOISE_MARGIN), the layouts' largest difference, and each real
error's size (> 1: caught). --json writes the same figures, with the raw differences.
usage: python tools/parity_margins.py [--model DIR] [--json OUT] [--no-env]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "dist"))
from parity import NOISE_MARGIN, REORDERED, SWAP, TOLERANCES, error  # noqa: E402  (the tests' own table)

ENV_REORDERED = {"mkl_generic": {"MKL_CBWR": "COMPATIBLE"}, "aten_no_avx": {"ATEN_CPU_CAPABILITY": "default"}}
LAYOUTS = {"tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"], "dp2": []}
REAL_ERRORS = {"actor_lr_x1.01": (1, ["train.actor_lr=2.02e-4"]),
               "critic_lr_x1.01": (1, ["train.critic_lr=2.02e-4"]),
               "swapped_shard": (2, ["parallel.tp=2", SWAP])}


def launch(model: str, out: Path, nproc: int, cases: dict[str, list[str]], env: dict | None = None) -> dict:
    """One probe launch running `cases` ({name: settings}) one after the other."""
    args = [a for name, settings in cases.items() for a in ("--case", name, "train.steps=3", *settings)]
    pre = [] if nproc == 1 else ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"]
    proc = subprocess.run([sys.executable, *pre, "tests/dist/layout_probe.py", model, str(out), *args],
                          cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"layout_probe failed ({nproc} ranks):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def run_all(model: str, with_env: bool) -> dict[str, list[dict]]:
    with tempfile.TemporaryDirectory() as tmp:
        one = {"ref": [], **REORDERED, **{k: s for k, (n, s) in REAL_ERRORS.items() if n == 1}}
        two = {**LAYOUTS, **{k: s for k, (n, s) in REAL_ERRORS.items() if n == 2}}
        runs = launch(model, Path(tmp) / "one.json", 1, one)
        runs |= launch(model, Path(tmp) / "two.json", 2, two)
        for name, env in ENV_REORDERED.items() if with_env else ():
            runs[name] = launch(model, Path(tmp) / f"{name}.json", 1, {"ref": []}, env)["ref"]
    return runs


def sizes(got: list[dict], ref: list[dict]) -> dict[str, dict]:
    """Per quantity: the largest error in tolerances, and the largest absolute and relative
    differences, over the steps (and elements) of two histories."""
    out: dict[str, dict] = {}
    for x, y in zip(got, ref):
        for key in TOLERANCES:
            if key not in x or key not in y:
                continue
            pairs = zip(x[key], y[key]) if isinstance(y[key], list) else [(x[key], y[key])]
            pairs = list(pairs)
            s = out.setdefault(key, {"tol_units": 0.0, "abs": 0.0, "rel": 0.0})
            s["tol_units"] = max(s["tol_units"], error(key, x[key], y[key]))
            s["abs"] = max(s["abs"], max(abs(a - b) for a, b in pairs))
            s["rel"] = max(s["rel"], max(abs(a - b) / max(abs(b), 1e-30) for a, b in pairs))
    return out


def margins(runs: dict[str, list[dict]]) -> dict[str, dict]:
    ref = runs["ref"]
    groups = {"noise": [n for n in [*REORDERED, *ENV_REORDERED] if n in runs], "layouts": list(LAYOUTS)}
    report = {}
    for key, tol in TOLERANCES.items():
        row = {"tolerance": {"abs": tol.abs, "rel": tol.rel}}
        for group, names in groups.items():
            worst = max(((sizes(runs[n], ref).get(key, {"tol_units": 0.0}), n) for n in names),
                        key=lambda t: t[0]["tol_units"])
            row[group] = {**worst[0], "by": worst[1]}
        row["margin"] = 1 / row["noise"]["tol_units"] if row["noise"]["tol_units"] else float("inf")
        row["real_errors"] = {n: sizes(runs[n], ref).get(key, {}) for n in REAL_ERRORS}
        report[key] = row
    return report


def show(report: dict[str, dict]) -> None:
    names = list(REAL_ERRORS)
    print(f"{'quantity':17s} {'tolerance':>15s} {'noise':>8s} {'by':>12s} {'margin':>7s} {'layouts':>8s} "
          + " ".join(f"{n:>16s}" for n in names))
    for key, row in report.items():
        t = row["tolerance"]
        tol = f"abs {t['abs']:.0e}" if t["abs"] else f"rel {t['rel']:.0e}"
        real = " ".join(f"{row['real_errors'][n].get('tol_units', 0.0):16.3g}" for n in names)
        flag = "" if row["margin"] >= NOISE_MARGIN else f"   < {NOISE_MARGIN:g}: too tight here"
        print(f"{key:17s} {tol:>15s} {row['noise']['tol_units']:8.3g} {row['noise']['by']:>12s} "
              f"{row['margin']:7.3g} {row['layouts']['tol_units']:8.3g} {real}{flag}")
    print("(noise, layouts and real errors in units of the tolerance: a real error must be > 1, "
          f"noise at most 1/{NOISE_MARGIN:g})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "artifacts" / "tiny_countdown"))
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--no-env", action="store_true",
                        help="skip the launches under MKL_CBWR / ATEN_CPU_CAPABILITY (2 fewer launches)")
    args = parser.parse_args()
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"--model={args.model!r} is not a model folder: build the tiny model with "
                         f"`python tools/make_tiny_model.py --out {args.model}` or pass --model")
    report = margins(run_all(args.model, not args.no_env))
    show(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
