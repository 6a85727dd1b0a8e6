"""What happens between two rounds of the partial-rollout controller in keep mode
(rollout.update_mode=keep), on scripted engines.

Held requests go on after the weight push, before the next round starts: a group can complete
and be scored then, and the next round's staleness rule can restart its samples while that
score is still being computed. A score lands only on the exact samples it scored (a restarted
group is scored again once it completes again), a request's result only on the slot it was sent
for, and an error raised between rounds is the next round's error (never lost).
"""
import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from scripted_engine import Clock
from test_rollout_stress import PROMPT, WorkloadEngine

from megarl.rollout.controller.partial import PartialRolloutController
from megarl.rollout.engines.engine import EngineError
from megarl.rollout.engines.pool import EnginePool


def lengths(gid: int, index: int) -> int:
    """Group 0 completes first; group 1 is held at the round's end and completes between
    rounds; later groups are longer (a restarted group 1 completes first in its round)."""
    return {0: 3, 1: 6}.get(gid, 8)


def score(sample) -> float:
    return float(len(sample.response_ids))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))   # a guard against a hang, not a timing


async def until(cond, clock, what: str, ticks: int = 200):
    start = clock.ticks
    while not cond():
        assert clock.ticks - start < ticks, f"{what} did not happen"
        await asyncio.sleep(0)


@pytest.mark.parametrize("policy", ["restart", "drop"])
def test_a_score_of_samples_restarted_meanwhile_is_not_trained(policy):
    """keep + restart / drop, max_staleness=0: group 1 is held at the end of round 0, completes
    after the push and is being scored when round 1 starts; round 1 restarts its samples (their
    tokens are a version old), or drops it. That score must not land: every trained group is
    complete, its rewards are the scores of exactly its trained samples, group 1 is trained once
    with its whole script (restart) or never (drop), and no error is lost."""
    gate, scored = threading.Event(), []

    def slow_score(sample):
        if sample.uid == 1 and not gate.is_set():
            gate.wait(30)             # group 1's first scoring runs while round 1 starts
        scored.append((sample.uid, len(sample.response_ids)))
        return score(sample)

    async def main():
        clock = Clock()
        clock.start()
        pool = EnginePool([WorkloadEngine("e0", clock, lengths)], 30, update_mode="keep")
        ctl = PartialRolloutController(
            pool, n=2, concurrency=4, max_new_tokens=64, temperature=1.0, max_staleness=0,
            stale_policy=policy, new_group=lambda: ({}, list(PROMPT)), score=slow_score, seed=0,
            scorer=ThreadPoolExecutor(max_workers=1))
        trained = []
        try:
            trained.append((0, await ctl.run_round(1, 0)))
            ctl.take_ready()
            assert ctl._inflight, "group 1 must be held at the end of round 0"
            await pool.reload_weights("/w", 1)          # held requests resume after the push
            await until(lambda: ctl._scoring, clock, "group 1 completing between rounds")
            nxt = asyncio.ensure_future(ctl.run_round(1, 1))
            await until(lambda: ctl.stats.restarted + ctl.stats.dropped_groups > 0 or nxt.done(), clock,
                        "round 1 restarting group 1")
            gate.set()
            trained.append((1, await nxt))
            ctl.take_ready()
            m = ctl.metrics()
            discarded = m["restarted_samples"], m["dropped_groups"], m["void_scores"]
            for k in (2,):
                await pool.reload_weights("/w", k)
                trained.append((k, await ctl.run_round(1, k)))
                ctl.take_ready()
        finally:
            gate.set()
            clock.stop()
        return trained, discarded
    trained, discarded = run(main())
    # round 1 restarted group 1's samples (or dropped it) while they were scored; that score was void
    assert discarded == ((2, 0, 1) if policy == "restart" else (0, 1, 1)), discarded
    gids = [g.gid for _, groups in trained for g in groups]
    assert len(gids) == len(set(gids)), gids
    assert (1 in gids) == (policy == "restart"), gids
    for _, groups in trained:
        for g in groups:
            assert g.complete, (g.gid, [s.finish_reason for s in g.slots])
            assert g.rewards == [float(len(s.response_ids)) for s in g.slots], (g.gid, g.rewards)
            for s in g.slots:
                assert s.response_ids == [1000 + p for p in range(lengths(g.gid, s.index))]


def test_an_error_between_rounds_is_the_next_rounds_error():
    """keep mode: a held request goes on after the push and its engine dies then, the last one
    of the pool. The error must end the next round (raised by run_round), not be dropped when
    that round starts (the round then waited for engines that no longer exist)."""
    class DiesBetweenRounds(WorkloadEngine):
        die = False

        async def generate(self, req):
            res = asyncio.ensure_future(super().generate(req))
            while not res.done():
                if self.die:
                    await self.abort([req.key])
                    raise EngineError(f"engine {self.name}: connection lost", partial=res.result())
                await self.clock.tick()
            return res.result()

    async def main():
        clock = Clock()
        clock.start()
        engine = DiesBetweenRounds("e0", clock, lengths)
        pool = EnginePool([engine], 30, failures_max=1, update_mode="keep")
        ctl = PartialRolloutController(
            pool, n=2, concurrency=4, max_new_tokens=64, temperature=1.0, max_staleness=4,
            stale_policy="restart", new_group=lambda: ({}, list(PROMPT)), score=score, seed=0)
        try:
            await ctl.run_round(1, 0)
            ctl.take_ready()
            assert ctl._inflight, "a request must be held at the end of round 0"
            await pool.reload_weights("/w", 1)
            engine.die = True
            await until(lambda: not ctl._inflight, clock, "the held request failing")
            try:
                await ctl.run_round(1, 1)
            except EngineError as err:
                return str(err)
            return None
        finally:
            clock.stop()
    err = run(main())
    assert err is not None and "e0" in err, err
