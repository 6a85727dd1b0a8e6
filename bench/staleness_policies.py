#!/usr/bin/env python
"""rollout.partial.stale_policy on the scripted engine: what each policy trains, and how fast.

    .venv/bin/python bench/staleness_policies.py [--steps 60]      # about a minute on 2 cores

The workloads of tests/unit/test_rollout_stress.py (concurrency 32, groups of 4, 3 groups per
step, two engines on one deterministic clock, no wall time involved):
- bimodal: half the prompts have one 64-token sample, the rest 3-token samples;
- long_tail: each sample 33-60 tokens with probability 1/6, else 2-12.
Per policy and max_staleness S: "speed" = clock ticks of the synchronous rollout (each step
waits for its longest sample) / the mode's ticks; mean requests running per tick; the share of
trained groups holding a long (> 32 tokens) sample, against the sync rollout's; trained tokens
over generated ones (what restart / drop throw away).
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests/unit")]

from scripted_engine import Clock  # noqa: E402
from test_rollout_stress import LONG, bimodal, drive, has_long, long_tail, sync_share  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    R, G, n, max_new = args.steps, 3, 4, 64
    for wl in (bimodal, long_tail):
        sync_ticks = sum(max(min(wl(g, j), max_new) for g in range(k * G, (k + 1) * G) for j in range(n))
                         for k in range(R))
        print(f"{wl.__name__}: sync trains long-sample share {sync_share(wl, R * G):.3f} in {sync_ticks} ticks "
              f"(long: > {LONG} tokens)")
        for policy, bounds in (("finish", [0, 1, 2, 3, 4, 10**6]), ("restart", [1, 2]), ("drop", [1, 2])):
            for S in bounds:
                clock = Clock()
                _, trained, metrics = asyncio.run(drive(wl, R, max_staleness=S, policy=policy, clock=clock))
                groups = [g for _, gs in trained for g in gs]
                generated = sum(m["rollout_tokens"] for m in metrics)
                kept = sum(len(s.response_ids) for g in groups for s in g.slots)
                running = sum(clock.running_total) / max(1, len(clock.running_total))
                print(f"  {policy:7s} S={'none' if S >= 10**6 else S:>4}: speed {sync_ticks / clock.ticks:5.2f}x, "
                      f"running {running:4.1f}/32, long share {sum(map(has_long, groups)) / len(groups):.3f}, "
                      f"trained/generated tokens {kept / max(1, generated):.2f}, "
                      f"restarted {sum(m['restarted_samples'] for m in metrics)}, "
                      f"dropped groups {sum(m['dropped_groups'] for m in metrics)}")


if __name__ == "__main__":
    main()
