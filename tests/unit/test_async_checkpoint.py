"""An async-mode checkpoint never loses or duplicates a group (issue 18, finding 3).

The driver (`Rollout`, megarl/rollout/controller/rounds.py) prefetches round k+1 on the pool's loop
thread; a checkpoint's snapshot runs on that loop at any moment. Here the snapshot is taken at
every loop offset from the moment round k+1 starts ending until well after its coroutine
returned (before the driver's `round` has taken its groups): each untrained group is in the
snapshot exactly once, the trained ones never, and the sampler's cursor counts exactly those.
"""
import asyncio
from types import SimpleNamespace

from scripted_engine import Clock
from test_rollout_stress import WorkloadEngine, long_tail

from megarl.data.prompts import PromptSampler
from megarl.rollout.controller.rounds import Rollout
from megarl.rollout.engines.pool import EnginePool, LoopThread, SyncPool

LOOP_THREAD = "test-engines"


class Tok:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [7, 7]}

    def decode(self, ids, skip_special_tokens=True):
        return ""


def config(step_multiple: int = 1):
    return SimpleNamespace(
        rollout=SimpleNamespace(
            mode="partial", sampling=SimpleNamespace(n=4, max_new_tokens=64, temperature=1.0, top_p=1.0, top_k=-1),
            group_filter="none", group_filter_max_draws=10,
            partial=SimpleNamespace(concurrency=12, max_staleness=2, stale_policy="finish", asynchronous=True,
                                    max_step_multiple=step_multiple)),
        run=SimpleNamespace(seed=0), train=SimpleNamespace(groups_per_step=3),
        data=SimpleNamespace(prompt_key="prompt", messages_key="messages"), env=SimpleNamespace(name=""))


def open_rollout(update_mode: str = "abort", step_multiple: int = 1):
    loop = LoopThread(LOOP_THREAD)
    clock = Clock()

    async def start():
        clock.start()
    loop.run(start(), 10)
    engines = EnginePool([WorkloadEngine(f"e{i}", clock, long_tail) for i in range(2)], 30, update_mode=update_mode)
    pool = SyncPool(engines, loop, 10)
    records = [{"prompt": f"q{i}"} for i in range(10_000)]
    rollout = Rollout(config(step_multiple), pool, records, PromptSampler(len(records), seed=0), Tok(),
                      lambda text, record, finished: 0.0)
    return rollout, clock


def close(rollout, clock):
    # the engines first, the clock still running: closing aborts what still runs (a prefetched
    # round), and an aborted request ends at its next tick (with the clock stopped first, the
    # close waited for those requests until its 120 s bound: seen once in a loaded full run)
    rollout.pool.call(rollout.pool.pool.close(), "closing the engines")

    async def stop():
        clock.stop()
    rollout.pool.call(stop(), "stopping the clock")
    rollout.pool.close()


def gids(state) -> list[int]:
    return [g["gid"] for g in state["open"] + state["completed"]]


def test_a_snapshot_at_any_loop_offset_around_an_async_round_end_keeps_every_group_once():
    for offset in range(25):   # the old code lost the round's groups at offset 3
        rollout, clock = open_rollout()
        try:
            samples, _ = rollout.round(0)
            trained = {s.uid for s in samples}
            ctl, before = rollout.controller, rollout.controller.stats

            async def snapshot_at(offset=offset, ctl=ctl, before=before, rollout=rollout):
                while ctl.stats is before or not ctl._ending:   # round 1 started, then ends
                    await asyncio.sleep(0)
                for _ in range(offset):
                    await asyncio.sleep(0)
                return await rollout.snapshot()
            rollout.prefetch(1)
            state, sampler = rollout.pool.loop.submit(snapshot_at()).result(30)
            taken = {s.uid for s in rollout.round(1)[0]}
        finally:
            close(rollout, clock)
        saved = gids(state)
        drawn = sampler["epoch"] * 10_000 + sampler["cursor"]
        assert len(saved) == len(set(saved)), (offset, "a group is in the snapshot twice")
        assert not trained & set(saved), (offset, "a trained group is in the snapshot")
        assert trained | set(saved) == set(range(drawn)), (offset, "a drawn group is neither trained nor saved")
        assert taken <= set(saved), offset

        if offset % 6:
            continue
        # restore into a fresh driver: its step 1 trains groups of the snapshot, none twice
        fresh, clock = open_rollout()
        try:
            fresh.load_state_dict({"sampler": sampler, "controller": state})
            again = [s.uid for s in fresh.round(1)[0][::4]]
        finally:
            close(fresh, clock)
        assert len(again) == 3 and not set(again) & trained, offset
        assert all(uid in saved or uid >= drawn for uid in again), offset


def test_an_elastic_async_round_generates_until_its_step_takes_it_and_a_snapshot_keeps_every_group_once():
    """Elastic steps (rollout.partial.max_step_multiple > 1) in async mode: the prefetched round
    does not end on its own (the engines keep generating while the trainer trains); a snapshot
    taken meanwhile holds every drawn, untrained group once; the step then takes a whole
    multiple of groups_per_step, none of them trained before."""
    for offset in (0, 7, 40):
        rollout, clock = open_rollout(step_multiple=4)
        try:
            samples, _ = rollout.round(0)
            trained = {s.uid for s in samples}
            ctl, before = rollout.controller, rollout.controller.stats

            async def snapshot_at(offset=offset, ctl=ctl, before=before, rollout=rollout):
                while ctl.stats is before:   # round 1 started
                    await asyncio.sleep(0)
                for _ in range(offset):
                    await asyncio.sleep(0)
                return await rollout.snapshot()
            rollout.prefetch(1)
            state, sampler = rollout.pool.loop.submit(snapshot_at()).result(30)

            async def still_open(ctl=ctl):
                # until a fixed step's round would end (its groups complete, none due still open)
                for _ in range(100_000):
                    if len(ctl.completed) >= 3 and not any(ctl._due(g) for g in ctl.groups.values()):
                        return ctl._round_done is not None and not ctl._ending
                    await asyncio.sleep(0)
                return False
            assert rollout.pool.call(still_open(), "reading"), offset   # not taken: still generating
            taken = [s.uid for s in rollout.round(1)[0][::4]]
        finally:
            close(rollout, clock)
        saved = gids(state)
        drawn = sampler["epoch"] * 10_000 + sampler["cursor"]
        assert len(saved) == len(set(saved)) and not trained & set(saved), offset
        assert trained | set(saved) == set(range(drawn)), offset
        assert len(taken) % 3 == 0 and 3 <= len(taken) <= 12 and not set(taken) & trained, offset
