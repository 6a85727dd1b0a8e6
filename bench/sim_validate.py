#!/usr/bin/env python
"""The simulator against the real thing on this CPU: one script, measured and predicted side by side.

    .venv/bin/python bench/sim_validate.py [--steps 5] [--concurrency 32,64]
        [--dists lognormal:mu=3,sigma=1.2;pareto:alpha=1.3,xmin=8;lognormal:mu=4,sigma=0.5]
        [--out bench/out/sim_validate.json]

For every (length distribution, concurrency): `bench/rollout_speedup.py` runs sync and partial
rollout on the real vLLM engine (tiny model, forced lengths, a fixed simulated train phase,
no per-cycle probes), then the simulator runs the same workload (same seeds, so the same
per-sample lengths; the same prompts' token counts) with the engine cost model calibrated
from THAT run's own probes: the decode-step curve t(b), prefill seconds per token, the
per-request overhead, and the weight-reload time. Nothing is fitted to the rollout times
being predicted. Prints the table (measured / predicted / error) and writes --out. Every
partial mode the benchmark ran is predicted under its own rollout.update_mode / keep_kv and
staleness bound (abort and keep side by side: rollout seconds, requests per trained sample,
re-prefilled tokens, tokens of requests spanning versions).

    .venv/bin/python bench/sim_validate.py --predict bench/out/rollout_speedup_X.json

predicts one existing result only (runs no benchmark).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megarl.sim.costs import MeasuredTrainer  # noqa: E402
from megarl.sim.recipe import measured_costs  # noqa: E402
from megarl.sim.run import SimSettings, simulate  # noqa: E402
from megarl.sim.workload import Workload, parse_dist  # noqa: E402

TRAIN_FIXED_S = 0.3


def prompt_lengths() -> list[int]:
    """Token counts of the dataset's prompts, in the order the benchmark uses them."""
    from transformers import AutoTokenizer

    from megarl.data.prompts import encode_prompts, load_prompts
    model = ROOT / "artifacts" / "tiny_countdown"
    records = load_prompts(str(model / "prompts.jsonl"), "prompt")
    return [len(p) for p in encode_prompts(AutoTokenizer.from_pretrained(str(model)), records, "prompt")]


def partial_modes(result: dict) -> list[str]:
    """The benchmark's partial-rollout modes (partial, partial_s2, partial_keep, partial_keep_kv:
    whichever it ran), each a dict of its figures."""
    return [m for m, v in result.items() if m.startswith("partial") and isinstance(v, dict) and "rollout_s" in v]


def predict(result: dict, bench_json: Path, lengths: list[int], trainer=None) -> dict:
    """The simulator on the benchmark's workload, per mode: sync, and each partial mode with
    its own rollout.update_mode / keep_kv and staleness bound (results before issue 20 name no
    update mode: they aborted, their EnginePool's default)."""
    engine, measured = measured_costs(str(bench_json))   # the engine model from this run's own probes
    trainer = trainer or measured
    w = Workload(parse_dist(result["length_dist"]), result["n"], result["max_len"], result["seed"],
                 prompt_len=lambda gid: lengths[gid % len(lengths)])
    out = {}
    for mode in ["sync", *partial_modes(result)]:
        fig = result.get(mode, {}) if mode != "sync" else {}
        update_mode = fig.get("update_mode", "abort")
        bound = fig.get("max_staleness")
        s = SimSettings(mode="sync" if mode == "sync" else "partial", steps=result["steps"],
                        groups_per_step=result["groups_per_step"], concurrency=result["concurrency"],
                        engines=result["engines"], seed=result["seed"], update_mode=update_mode,
                        keep_kv=update_mode == "keep" and fig.get("keep_kv", False),
                        max_staleness=10**9 if bound is None else bound,
                        stale_policy=fig.get("stale_policy", "finish"))
        out[mode] = simulate(s, w, engine, trainer)
    return out


def compare_modes(result: dict, sim: dict) -> list[dict]:
    """Measured against predicted, per partial mode: rollout seconds, requests per trained
    sample, re-prefilled tokens (the controller's count: continuation tokens sent again, plus
    held context whose KV an update dropped) and tokens of requests spanning versions."""
    rows = []
    for m in partial_modes(result):
        meas, pred = result[m], sim[m]
        rows.append({"mode": m, "update_mode": meas.get("update_mode", "abort"), "keep_kv": meas.get("keep_kv", False),
                     "rollout_s": [meas["rollout_s"], pred["rollout_s"]],
                     # the benchmark's ratio: every request sent / samples trained (samples still
                     # open at the end count on top; the simulator's requests_per_trained_sample
                     # counts only the trained samples' own requests)
                     "requests_per_trained_sample": [meas.get("requests_per_trained_sample"),
                                                     pred["requests"] / max(1, pred["trained_samples"])],
                     "reprefill_tokens": [meas.get("reprefill_tokens"),
                                          pred["resent_tokens"] + pred["kv_recomputed_response_tokens"]],
                     "tokens_of_spanning_requests": [meas.get("tokens_of_spanning_requests"),
                                                     pred["multi_version_tokens"]]})
    return rows


def print_modes(rows: list[dict]) -> None:
    def pair(v, fmt):
        return " / ".join("-" if x is None else format(x, fmt) for x in v)
    print("\n| mode | update_mode | keep_kv | rollout s: measured / predicted | requests per trained sample | "
          "re-prefilled tokens | tokens of requests over >1 version |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['update_mode']} | {r['keep_kv']} | {pair(r['rollout_s'], '.1f')} | "
              f"{pair(r['requests_per_trained_sample'], '.2f')} | {pair(r['reprefill_tokens'], 'd')} | "
              f"{pair(r['tokens_of_spanning_requests'], 'd')} |")


def predict_one(path: str) -> None:
    """--predict: one existing bench/rollout_speedup.py result, every mode it ran."""
    result = json.loads(Path(path).read_text())
    sim = predict(result, Path(path), prompt_lengths())
    print(f"sync rollout s: measured {result['sync_rollout_s']:.1f} / predicted {sim['sync']['rollout_s']:.1f}")
    print_modes(compare_modes(result, sim))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dists", default="lognormal:mu=3,sigma=1.2;pareto:alpha=1.3,xmin=8;lognormal:mu=4,sigma=0.5")
    p.add_argument("--concurrency", default="32,64")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--max-len", type=int, default=384)
    p.add_argument("--out", default=str(ROOT / "bench/out/sim_validate.json"))
    p.add_argument("--reuse", action="store_true", help="predict from existing benchmark JSONs only")
    p.add_argument("--predict", metavar="RESULT_JSON", help="only predict this bench/rollout_speedup.py result "
                   "(every mode it ran: abort and keep modes side by side); runs no benchmark")
    a = p.parse_args()
    if a.predict:
        predict_one(a.predict)
        return
    out_dir = Path(a.out).parent / "sim_validate"
    out_dir.mkdir(parents=True, exist_ok=True)
    lengths = prompt_lengths()
    rows, t_begin = [], time.perf_counter()
    for i, dist in enumerate(a.dists.split(";")):
        for conc in (int(c) for c in a.concurrency.split(",")):
            name = f"d{i}_c{conc}"
            bench_json = out_dir / f"{name}.json"
            if not a.reuse:
                t = time.perf_counter()
                cmd = [sys.executable, str(ROOT / "bench/rollout_speedup.py"), "--length-dist", dist,
                       "--max-len", str(a.max_len), "--steps", str(a.steps), "--min-steps", str(a.steps),
                       "--concurrency", str(conc), "--train", f"sim:fixed={TRAIN_FIXED_S},per_ktok=0",
                       "--curve-pass-tokens", "0", "--out", str(bench_json), "--png", str(out_dir / f"{name}.png")]
                with open(out_dir / f"{name}.log", "w") as log:
                    subprocess.run(cmd, check=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
                print(f"[{name}] measured in {time.perf_counter() - t:.0f} s", flush=True)
            result = json.loads(bench_json.read_text())
            sim = predict(result, bench_json, lengths, MeasuredTrainer(TRAIN_FIXED_S, 0.0))   # its train phase
            meas = {"sync": result["sync_rollout_s"], "partial": result["partial_rollout_s"]}
            row = {"dist": dist, "concurrency": conc, "steps": result["steps"],
                   "measured_sync_s": meas["sync"], "predicted_sync_s": sim["sync"]["rollout_s"],
                   "measured_partial_s": meas["partial"], "predicted_partial_s": sim["partial"]["rollout_s"],
                   "measured_speedup": meas["sync"] / meas["partial"],
                   "predicted_speedup": sim["sync"]["rollout_s"] / sim["partial"]["rollout_s"],
                   "measured_requests_partial": result["partial"]["requests"],
                   "predicted_requests_partial": sim["partial"]["requests"],
                   "trained_tokens_partial": [result["partial"]["trained_tokens"], sim["partial"]["trained_tokens"]],
                   "load_avg_at_end": result["machine"]["load_avg_at_end"][0],
                   "modes": compare_modes(result, sim)}
            for k in ("sync", "partial", "speedup"):
                mk, pk = ((f"measured_{k}_s", f"predicted_{k}_s") if k != "speedup"
                          else ("measured_speedup", "predicted_speedup"))
                row[f"error_{k}"] = row[pk] / row[mk] - 1.0
            rows.append(row)
    print("\n| length distribution | C | sync s: measured / predicted (err) | partial s: measured / "
          "predicted (err) | speedup: measured / predicted (err) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dist']} | {r['concurrency']} | {r['measured_sync_s']:.1f} / {r['predicted_sync_s']:.1f} "
              f"({100 * r['error_sync']:+.0f}%) | {r['measured_partial_s']:.1f} / {r['predicted_partial_s']:.1f} "
              f"({100 * r['error_partial']:+.0f}%) | {r['measured_speedup']:.2f} / {r['predicted_speedup']:.2f} "
              f"({100 * r['error_speedup']:+.0f}%) |")
    print_modes([dict(m, mode=f"{r['dist']} C={r['concurrency']} {m['mode']}") for r in rows for m in r["modes"]])
    worst = max(abs(r[f"error_{k}"]) for r in rows for k in ("sync", "partial", "speedup"))
    within = sum(abs(r[f"error_{k}"]) <= 0.15 for r in rows for k in ("sync", "partial", "speedup"))
    print(f"\n{within}/{3 * len(rows)} figures within 15% (worst {100 * worst:.0f}%); "
          f"{time.perf_counter() - t_begin:.0f} s in all")
    Path(a.out).write_text(json.dumps({"rows": rows, "worst_abs_error": worst,
                                       "runtime_s": time.perf_counter() - t_begin}, indent=1))


if __name__ == "__main__":
    main()
