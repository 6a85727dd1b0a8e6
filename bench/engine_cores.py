"""Two CPU engines on one core each vs both on the first core: generation throughput.

vLLM's `auto` CPU binding makes every engine local rank 0 of its own world, so every engine
on a machine pinned its worker to the same first core; megarl now gives each engine megarl
starts cores of its own (`rollout/engines/build.py` engine_env, `vllm_settings.cpu_binds`). This
bench measures what that changes for generation: the same requests (fixed lengths,
`ignore_eos`) spread over a pool of `--engines` in-process engines, once with every engine
bound to the first core (`VLLM_CPU_OMP_THREADS_BIND=<first core>`, which megarl leaves as
the user set it: the old behaviour) and once with megarl's own binds, in one run.

    .venv/bin/python bench/engine_cores.py [--engines 2] [--requests 64] [--tokens 96] [--repeats 2]

Writes bench/out/engine_cores.json; prints tokens/s of both and their ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megarl.bootstrap import bootstrap  # noqa: E402

bootstrap()

from megarl.config import load_config  # noqa: E402
from megarl.rollout.engines.engine import GenRequest  # noqa: E402
from megarl.rollout.engines.pool import open_pool  # noqa: E402
from megarl.rollout.engines.vllm_settings import BIND_ENV  # noqa: E402

MODEL = ROOT / "artifacts" / "tiny_countdown"


def measure(engines: int, requests: int, tokens: int, repeats: int, first_core_only: bool) -> dict:
    """Pool start and generation seconds of `repeats` rounds of `requests` x `tokens`."""
    cores = sorted(os.sched_getaffinity(0))
    old = os.environ.pop(BIND_ENV, None)
    if first_core_only:
        os.environ[BIND_ENV] = str(cores[0])
    cfg = load_config(str(ROOT / "recipes/tiny_cpu.yaml"),
                      [f"model.path={MODEL}", f"rollout.engines.count={engines}", "rollout.engines.timeout_s=600"])
    t0 = time.perf_counter()
    pool = open_pool(cfg.rollout, str(MODEL), 0, tempfile.mkdtemp(prefix="megarl-bench-cores-"))
    start_s = time.perf_counter() - t0
    try:
        prompt = [1, 20, 4, 7, 9, 11]
        pool.generate_many([GenRequest("warm", prompt, 4)])
        rounds = []
        for rep in range(repeats):
            reqs = [GenRequest(f"r{rep}-{i}", prompt, tokens, seed=i, ignore_eos=True) for i in range(requests)]
            t = time.perf_counter()
            out = pool.generate_many(reqs)
            secs = time.perf_counter() - t
            rounds.append({"s": secs, "tokens": sum(len(r.token_ids) for r in out)})
    finally:
        pool.close()
        os.environ.pop(BIND_ENV, None)
        if old is not None:
            os.environ[BIND_ENV] = old
    s = statistics.median(r["s"] for r in rounds)
    return {"first_core_only": first_core_only, "pool_start_s": start_s, "rounds": rounds,
            "median_s": s, "tokens_per_s": rounds[0]["tokens"] / s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench/out/engine_cores.json"))
    a = ap.parse_args()
    if not (MODEL / "config.json").exists():
        sys.exit(f"{MODEL} is missing: run `make model` first")
    t_all = time.perf_counter()
    old = measure(a.engines, a.requests, a.tokens, a.repeats, first_core_only=True)
    new = measure(a.engines, a.requests, a.tokens, a.repeats, first_core_only=False)
    result = {"engines": a.engines, "requests": a.requests, "tokens": a.tokens, "repeats": a.repeats,
              "first_core_only": old, "own_cores": new, "speedup": new["tokens_per_s"] / old["tokens_per_s"],
              "runtime_s": time.perf_counter() - t_all, "cpus": sorted(os.sched_getaffinity(0)),
              "loadavg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"{a.engines} engines, {a.requests} requests x {a.tokens} tokens, median of {a.repeats}:")
    print(f"  every engine on the first core: {old['tokens_per_s']:.0f} tokens/s ({old['median_s']:.2f} s)")
    print(f"  an engine per core (megarl):    {new['tokens_per_s']:.0f} tokens/s ({new['median_s']:.2f} s)")
    print(f"  speedup {result['speedup']:.2f}x; in {a.out} ({result['runtime_s']:.0f} s)")


if __name__ == "__main__":
    main()
