"""Failover never returns a cut-off sample as final (scripted engines, deterministic clock).

When the pool retires an engine it closes it, and the engine's other requests resolve as
finish_reason="abort" partials, as real engines do when closed. Those samples were not cut
on purpose: the pool continues each from its tokens on another engine, exactly as it
continues a request whose own call failed. Only an abort the pool was asked for (pool.abort,
a weight update in rollout.update_mode=abort) or a caller that gave up returns a partial.
"""
import asyncio

import pytest
from scripted_engine import ScriptedEngine, assert_whole, run_on_clock

from megarl.rollout.controller.sync_rollout import generate_groups
from megarl.rollout.engines.engine import EngineError, GenRequest
from megarl.rollout.engines.pool import EnginePool

LENGTH = 40


def test_a_hung_engine_retired_on_its_first_timeout_leaves_no_cut_off_sample():
    """e0 hangs after 5 tokens of each request; the first request to time out retires it; its
    other requests come back "abort" when it is closed and must be finished on e1."""
    async def main(clock):
        hung = ScriptedEngine("e0", clock, stall_after=5, timeout_ticks=10)
        healthy = ScriptedEngine("e1", clock)
        pool = EnginePool([hung, healthy], 30, failures_max=1)
        prompts = [[g, 0, LENGTH] for g in range(4)]
        samples = await generate_groups(pool, [{} for _ in prompts], prompts, 4, 64)
        return pool, samples
    pool, samples = run_on_clock(main)
    assert [e.name for e in pool.retired] == ["e0"] and len(pool.failures) == 1
    assert len(samples) == 16
    for s in samples:
        assert_whole(s.response_ids, s.logprobs, s.finish_reason, LENGTH)
        assert s.stopped


def test_a_live_engine_that_aborts_on_its_own_is_retired_and_the_sample_finished_elsewhere():
    """An engine ending a request as aborted when nobody asked is failing (the contract: abort
    only on request): it is retired and the request continues from its tokens."""
    class AbortsOnItsOwn(ScriptedEngine):
        async def generate(self, req):
            task = asyncio.ensure_future(super().generate(req))
            while req.key not in self._running:
                await asyncio.sleep(0)
            while len(self.partial(req.key).token_ids) < 7:
                await self.clock.tick()
            await super().abort([req.key])
            return await task

    async def main(clock):
        bad, good = AbortsOnItsOwn("e0", clock), ScriptedEngine("e1", clock)
        pool = EnginePool([bad, good], 30, failures_max=1)
        result = await pool.generate(GenRequest("k", [0, 0, LENGTH], 64), bad)
        return pool, result
    pool, result = run_on_clock(main)
    assert_whole(result.token_ids, result.logprobs, result.finish_reason, LENGTH)
    assert [e.name for e in pool.retired] == ["e0"]


def test_an_abort_asked_for_still_returns_the_partial():
    async def main(clock):
        engines = [ScriptedEngine("e0", clock), ScriptedEngine("e1", clock)]
        pool = EnginePool(engines, 30)
        task = asyncio.ensure_future(pool.generate(GenRequest("k", [0, 0, LENGTH], 64)))
        while clock.ticks < 5:
            await asyncio.sleep(0)
        await pool.abort(["k"])
        return pool, await task
    pool, result = run_on_clock(main)
    assert result.finish_reason == "abort" and 0 < len(result.token_ids) < LENGTH
    assert pool.failures == [] and sum(e.served for e in pool.engines) == 1


@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_a_weight_update_returns_or_holds_requests_as_its_mode_says(mode):
    """update_mode=abort: the update's abort is the pool's own, the request returns its partial
    (its caller continues it under the new weights); keep: held, then finished whole."""
    async def main(clock):
        engine = ScriptedEngine("e0", clock)
        pool = EnginePool([engine, ScriptedEngine("e1", clock)], 30, update_mode=mode)
        task = asyncio.ensure_future(pool.generate(GenRequest("k", [0, 0, LENGTH], 64), engine))
        while clock.ticks < 5:
            await asyncio.sleep(0)
        await pool.begin_update()
        for e in pool.engines:
            await e.reload_weights("unused", 1)
        await pool.end_update()
        return pool, await task
    pool, result = run_on_clock(main)
    assert pool.failures == []
    if mode == "abort":
        assert result.finish_reason == "abort" and 0 < len(result.token_ids) < LENGTH
    else:
        assert_whole(result.token_ids, result.logprobs, result.finish_reason, LENGTH)
        assert set(result.versions) == {0, 1}


def test_a_caller_that_gives_up_retires_no_engine():
    """A generate() cancelled by its caller (a deadline of the synchronous driver) resolves the
    engine's request as aborted: that is not the engine's fault."""
    class Swallows(ScriptedEngine):
        async def generate(self, req):     # as the in-process engine: a cancel resolves the partial
            task = asyncio.ensure_future(super().generate(req))
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:
                await super().abort([req.key])
                return task.result()

    async def main(clock):
        engines = [Swallows("e0", clock), ScriptedEngine("e1", clock)]
        pool = EnginePool(engines, 30)
        task = asyncio.ensure_future(pool.generate(GenRequest("k", [0, 0, LENGTH], 64), engines[0]))
        while clock.ticks < 5:
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return pool, engines
    pool, engines = run_on_clock(main)
    assert pool.failures == [] and engines[1].served == 0


def test_when_the_last_engine_is_retired_its_other_requests_fail_naming_it():
    """No engine to continue on: the cut-off requests raise (the run stops naming the engine),
    never return as if they had ended."""
    async def main(clock):
        pool = EnginePool([ScriptedEngine("e0", clock, stall_after=5, timeout_ticks=10)], 30, failures_max=3)
        tasks = [pool.generate(GenRequest(f"k{i}", [i, 0, LENGTH], 64)) for i in range(3)]
        return await asyncio.gather(*tasks, return_exceptions=True)
    outcomes = run_on_clock(main)
    assert all(isinstance(o, EngineError) and "no rollout engine left" in str(o) for o in outcomes), outcomes
