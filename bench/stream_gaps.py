"""How evenly a vLLM server that megarl starts streams its tokens: the largest gap between two
SSE events of one request, with `curl -N` as the client (no megarl code in the path).

A server started by `LocalServer.start()` (a process group of its own in the caller's
session) is compared, in one run, with the same command and environment started in a session
of its own (`--also-new-session`): where the kernel groups CPU scheduling by session
(`/proc/sys/kernel/sched_autogroup_enabled` = 1), the second one delivered its stream in
bursts seconds apart while the engine kept generating. Each server gets `--requests` greedy
requests of `--tokens` tokens one after another (the tiny model with 4,096 positions); the
first request of each server is its warm-up and is not counted.

    .venv/bin/python bench/stream_gaps.py [--runs 3] [--requests 6] [--tokens 4000] [--also-new-session]
    .venv/bin/python bench/stream_gaps.py --compare-eager     (start and decode: eager vs compiled)

Writes bench/out/stream_gaps.json; prints the largest gap of each run.
"""
from __future__ import annotations

import argparse
import json
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megarl.rollout.engines.servers import SERVED_MODEL_NAME, LocalServer, _die_with_parent  # noqa: E402
from tools.model_positions import with_positions  # noqa: E402

MODEL = ROOT / "artifacts" / "tiny_countdown"
MAX_LEN = 4096


class NewSessionServer(LocalServer):
    """The same server in a session of its own (how megarl started servers before)."""

    @staticmethod
    def popen_group() -> dict:
        return {"start_new_session": True, "preexec_fn": _die_with_parent}


def event_gaps(server: LocalServer, tokens: int, seed: int) -> dict:
    """One streamed request through curl; the arrival time of each SSE event line."""
    body = json.dumps({"model": SERVED_MODEL_NAME, "prompt": [1, 5 + seed, 9, 17], "max_tokens": tokens,
                       "temperature": 0.0, "ignore_eos": True, "stream": True, "logprobs": 0,
                       "return_token_ids": True})
    cmd = ["curl", "-sN", "--noproxy", "*", "-H", "Content-Type: application/json",
           "-H", f"Authorization: Bearer {server.api_key}", "-d", body, server.url + "/v1/completions"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE)
    times = []
    t0 = time.perf_counter()
    for line in proc.stdout:
        if line.startswith(b"data:"):
            times.append(time.perf_counter())
    proc.wait()
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"events": len(times), "max_gap_s": max(gaps, default=0.0), "seconds": time.perf_counter() - t0}


def measure(kind, model: Path, log_dir: Path, requests: int, tokens: int, eager: bool = True) -> dict:
    server = kind(model, log_dir / f"{kind.__name__}.log", api_key=secrets.token_hex(16),
                  max_model_len=MAX_LEN, kv_cache_mb=256, enforce_eager=eager)
    t0 = time.perf_counter()
    server.start()
    try:
        server.wait_healthy(900)
        start_s = time.perf_counter() - t0
        reqs = [event_gaps(server, tokens, i) for i in range(requests)]
    finally:
        server.stop()
    counted = reqs[1:]     # the first request warms the server up
    return {"requests": reqs, "start_s": start_s, "max_gap_s": max(r["max_gap_s"] for r in counted),
            "median_request_s": statistics.median(r["seconds"] for r in counted)}


def compare_eager(model: Path, log_dir: Path, requests: int, tokens: int) -> dict:
    """The CPU default of rollout.engines.enforce_eager: start time and decode time of the same
    requests with vLLM's compiled graphs and eager, one server after the other."""
    out = {}
    for eager in (True, False):
        r = measure(LocalServer, model, log_dir, requests, tokens, eager=eager)
        out["eager" if eager else "compiled"] = {"start_s": r["start_s"], "median_request_s": r["median_request_s"]}
        print(f"enforce_eager={eager}: start {r['start_s']:.0f} s, median request {r['median_request_s']:.2f} s",
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--also-new-session", action="store_true",
                    help="also measure the same server in a session of its own")
    ap.add_argument("--compare-eager", action="store_true",
                    help="instead: start and decode seconds with enforce_eager true and false")
    ap.add_argument("--out", default=str(ROOT / "bench/out/stream_gaps.json"))
    a = ap.parse_args()
    if not (MODEL / "config.json").exists():
        sys.exit(f"no tiny model at {MODEL}: run `make model` first")
    kinds = [LocalServer] + ([NewSessionServer] if a.also_new_session else [])
    autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled")
    result = {"autogroup": autogroup.read_text().strip() if autogroup.exists() else "absent",
              "tokens": a.tokens, "requests": a.requests, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="megarl-bench-gaps-") as tmp:
        model = with_positions(MODEL, Path(tmp) / "long_model", MAX_LEN)
        if a.compare_eager:
            kinds = []
            result["eager"] = compare_eager(model, Path(tmp), a.requests, a.tokens)
        for kind in kinds:
            runs = [measure(kind, model, Path(tmp), a.requests, a.tokens) for _ in range(a.runs)]
            result["runs"][kind.__name__] = runs
            print(f"{kind.__name__}: largest gap per run (s) "
                  f"{', '.join('%.3f' % r['max_gap_s'] for r in runs)}", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"in {a.out}")


if __name__ == "__main__":
    main()
