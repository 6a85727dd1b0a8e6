#!/usr/bin/env python
"""A slow reward and the engines' slots: slot utilisation during partial rounds with a reward
that costs nothing, a slow one scored by the run's reward runner (off the engines' loop), and
the same slow one scored on the loop (what the runner avoids), in one run.

    .venv/bin/python bench/reward_overlap.py [--rounds 6] [--reward-s 0.05] [--out bench/out/reward_overlap.json]

The engines are megarl's simulated engines (megarl/sim/engine.py) on a real-time event loop:
a decode step takes 2 ms + 0.05 ms per running request, so the rounds take wall time the way
a real engine's do, without one. The controller is the stock PartialRolloutController
(concurrency 16, n 4, 4 groups per round, lengths 20-120 tokens, stale_policy restart); the
slow reward sleeps --reward-s per sample in a plain function (time.sleep: the thread is busy),
run by megarl.rewards.RewardRunner at reward.concurrency 8. Reported per case: the mean of
rollout_slots_used (requests in flight over the concurrency, time-weighted) and
rollout_inflight_min over the rounds, round wall time, and the ratio of each case's slot
utilisation to the instant reward's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarl.rewards import RewardRunner, VerifierEntry  # noqa: E402
from megarl.rollout.controller.partial import PartialRolloutController  # noqa: E402
from megarl.rollout.controller.scoring import score_group  # noqa: E402
from megarl.rollout.engines.pool import EnginePool  # noqa: E402
from megarl.sim.engine import SimEngine  # noqa: E402


class Costs:
    load_weights_s = 0.0

    def step_s(self, batch: int, context_tokens: int, prefill_tokens: int, new_requests: int) -> float:
        return 0.002 + 0.00005 * batch


def length(gid: int, index: int) -> int:
    return 20 + (gid * 37 + index * 53) % 100


async def one_case(case: str, rounds: int, reward_s: float) -> dict:
    pool = EnginePool([SimEngine(f"sim{i}", Costs()) for i in range(2)], 30)
    for e in pool.engines:
        await e.start()

    def slow(response_text, record, *, finished):
        time.sleep(reward_s)
        return float(len(response_text))
    runner = None
    if case == "slow_runner":
        runner = RewardRunner(VerifierEntry(slow, False, False), timeout_s=60, concurrency=8)
    tokenizer = SimpleNamespace(decode=lambda ids, **k: "t" * len(ids))
    kwargs = {"score": (lambda s: float(len(s.response_ids)))}
    if case == "slow_on_loop":
        kwargs = {"score": lambda s: slow("t" * len(s.response_ids), s.record, finished=True)}
    if runner is not None:
        kwargs = {"score": None, "scorer": lambda samples: score_group(samples, tokenizer, runner)}
    ctl = PartialRolloutController(pool, n=4, concurrency=16, max_new_tokens=128, temperature=1.0, max_staleness=8,
                                   stale_policy="restart", new_group=lambda: ({}, [1, 2, 3]), seed=0,
                                   budget_of=length, ignore_eos=True, **kwargs)
    metrics, walls = [], []
    try:
        for version in range(rounds):
            t0 = time.perf_counter()
            await ctl.run_round(4, version)
            walls.append(time.perf_counter() - t0)
            ctl.take_ready()
            metrics.append(ctl.metrics())
            await pool.reload_weights("/nowhere", version + 1)
    finally:
        if runner is not None:
            runner.close()
        await pool.close()
    return {"rollout_slots_used_mean": statistics.mean(m["rollout_slots_used"] for m in metrics),
            "rollout_inflight_min": min(m.get("rollout_inflight_min", 16) for m in metrics),
            "round_wall_s_mean": statistics.mean(walls), "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reward-s", type=float, default=0.05)
    ap.add_argument("--out", default="bench/out/reward_overlap.json")
    a = ap.parse_args()
    cases = {c: asyncio.run(one_case(c, a.rounds, a.reward_s)) for c in ("instant", "slow_runner", "slow_on_loop")}
    base = cases["instant"]["rollout_slots_used_mean"]
    for c in cases.values():
        c["slots_used_vs_instant"] = c["rollout_slots_used_mean"] / base
    out = {"reward_s": a.reward_s, "concurrency": 16, "reward_concurrency": 8, "cases": cases}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
