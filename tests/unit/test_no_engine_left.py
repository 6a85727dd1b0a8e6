"""When the last engine is retired, every request still in flight fails with one message that
names an engine (the last one retired, with its address and log where it has them), so the run
stops with one line naming the engine whichever request's error the caller reports first
(scripted engines on a deterministic clock)."""
import asyncio

from scripted_engine import ScriptedEngine, run_on_clock

from megarl.rollout.controller.sync_rollout import generate_groups
from megarl.rollout.engines.engine import EngineError
from megarl.rollout.engines.pool import EnginePool


def test_every_request_cut_off_by_the_last_retirement_names_the_engine():
    async def main(clock):
        engines = [ScriptedEngine(f"e{i}", clock, stall_after=3, timeout_ticks=5 * (i + 1)) for i in range(2)]
        pool = EnginePool(engines, 30, failures_max=5)
        prompts = [[g, 0, 40] for g in range(4)]
        outcomes = await asyncio.gather(*(generate_groups(pool, [{}], [p], 2, 64, tag=f"{i}-")
                                          for i, p in enumerate(prompts)), return_exceptions=True)
        return pool, outcomes
    pool, outcomes = run_on_clock(main)
    assert [f["engine"] for f in pool.failures] == ["e0", "e1"] and pool.engines == []
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(errors) == 4 and all(isinstance(e, EngineError) for e in errors), outcomes
    for err in errors:
        assert "no rollout engine left" in str(err), err
        assert "engine e1" in str(err), f"the error names no engine: {err}"
