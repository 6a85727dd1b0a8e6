"""Aborts reach only what they were meant for (issue 18, findings 6 and 7), on scripted engines.

- a round's end (and an async hold) aborts the controller's own requests: a weight-sync probe
  or another scheduler on the same engines runs to its end.
- a request aborted while its engine hangs is not re-sent elsewhere once that engine is
  retired: it resolves as aborted with the tokens it had.
- a verify probe that returned no tokens (gap 0/0 = NaN) fails the check.
"""
import asyncio
import math

import pytest
from scripted_engine import Clock, ScriptedEngine
from test_rollout_stress import PROMPT, WorkloadEngine, long_tail

from megarl.rollout.controller.partial import PartialRolloutController
from megarl.rollout.engines.engine import EngineError, GenRequest
from megarl.rollout.engines.pool import EnginePool
from megarl.rollout.weights import sync as weight_sync


class Either(WorkloadEngine):
    """Controller requests (keys g<gid>s<i>a<n>) get the workload's lengths; others (probes)
    use the plain scripted prompt [gid, index, length]."""

    async def generate(self, req):
        if req.key.startswith("g"):
            return await super().generate(req)
        return await ScriptedEngine.generate(self, req)


def test_a_round_end_does_not_abort_a_probe_on_the_same_engines():
    async def main():
        clock = Clock()
        clock.start()
        pool = EnginePool([Either(f"e{i}", clock, long_tail) for i in range(2)], 30)
        ctl = PartialRolloutController(pool, n=4, concurrency=8, max_new_tokens=64, temperature=1.0,
                                       max_staleness=8, new_group=lambda: ({}, list(PROMPT)),
                                       score=lambda s: 0.0, seed=0, sample_every_s=None)
        probe = asyncio.ensure_future(pool.generate(GenRequest("probe-e0-0", [0, 0, 300], 300), pool.engines[0]))
        try:
            await ctl.run_round(3, 0)
            assert not probe.done()
            nxt = asyncio.ensure_future(ctl.run_round(3, 1))
            start = clock.ticks
            while clock.ticks < start + 3:
                await asyncio.sleep(0)
            await ctl.hold()                # as an async round is held for a weight update
            assert not probe.done()
            ctl.release()
            await nxt
            result = await probe
        finally:
            clock.stop()
        return ctl, result
    ctl, result = asyncio.run(main())
    assert ctl.metrics()["aborted_inflight"] > 0, "the round must have aborted its own requests"
    assert result.finish_reason == "stop" and len(result.token_ids) == 300


class HangsAtAbort(ScriptedEngine):
    """Its abort times out (raises, as a hung engine's does); its streams then break, handing
    back the tokens they had."""

    def __init__(self, name, clock):
        super().__init__(name, clock)
        self.hung = False

    async def abort(self, keys=None):
        self.hung = True
        raise EngineError(f"engine {self.name}: abort not answered within 30 s")

    async def generate(self, req):
        task = asyncio.ensure_future(super().generate(req))
        while not task.done() and not self.hung:
            await self.clock.tick()
        if task.done():
            return task.result()
        await super().abort([req.key])
        raise EngineError(f"engine {self.name}: stream broken", partial=task.result())


def test_a_request_aborted_on_a_hung_engine_is_not_resent_elsewhere():
    async def main():
        clock = Clock()
        clock.start()
        hung, healthy = HangsAtAbort("e0", clock), ScriptedEngine("e1", clock)
        pool = EnginePool([hung, healthy], 30, failures_max=1)
        tasks = [asyncio.ensure_future(pool.generate(GenRequest(f"r{i}", [i, 0, 1000], 1000), hung))
                 for i in range(3)]
        try:
            while clock.ticks < 5:
                await asyncio.sleep(0)
            await pool.abort(["r0", "r1", "r2"])
            results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        finally:
            clock.stop()
        return pool, healthy, results
    pool, healthy, results = asyncio.run(main())
    assert [e.name for e in pool.retired] == ["e0"]
    assert healthy.served == 0, "an aborted request was re-sent to the other engine"
    for r in results:
        assert r.finish_reason == "abort" and 0 < len(r.token_ids) < 1000


def test_a_request_aborted_before_it_started_is_never_sent():
    async def main():
        clock = Clock()
        clock.start()
        engine = ScriptedEngine("e0", clock)
        pool = EnginePool([engine], 30)
        task = asyncio.ensure_future(pool.generate(GenRequest("k", [0, 0, 50], 50)))
        await pool.abort(["k"])            # the task has not run yet
        try:
            return engine, await task
        finally:
            clock.stop()
    engine, result = asyncio.run(main())
    assert result.finish_reason == "abort" and result.token_ids == [] and engine.served == 0


@pytest.mark.parametrize("gaps", [{"e0": 1e-7, "e1": math.nan}, {"e0": math.nan}])
def test_a_verify_probe_without_tokens_fails(monkeypatch, gaps):
    """engine_mismatch's gap is 0/0 = NaN for an engine whose probe came back empty."""
    monkeypatch.setattr(weight_sync, "engine_mismatch", lambda *a, **k: dict(gaps))
    with pytest.raises(weight_sync.WeightSyncError, match="returned no tokens"):
        weight_sync.verify(None, None, [[1]], 8, 1)
    monkeypatch.setattr(weight_sync, "engine_mismatch", lambda *a, **k: {"e0": 1e-7})
    assert weight_sync.verify(None, None, [[1]], 8, 1) == 1e-7
