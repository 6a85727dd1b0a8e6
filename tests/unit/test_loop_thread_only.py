"""The partial-rollout controller is used on its event loop's thread only.

Its state (open groups, the completed ones, slots) changes on the pool's loop thread: requests
finish, groups are scored and queued, held requests run on between rounds (keep mode). The
driver (`Rollout`, rounds.py) runs on another thread, so every read it makes (a round's
samples and metrics, the pending l_old, a snapshot, a restore) must run on the loop, never
iterate the controller's dicts from its own thread. Scripted engines of test_async_checkpoint.
"""
import threading

import pytest
from test_async_checkpoint import LOOP_THREAD, open_rollout

from megarl.rollout.controller.partial import PartialRolloutController

PUBLIC = ["run_round", "take_ready", "metrics", "pending_old_logprobs", "store_old_logprobs", "samples_of",
          "state_dict", "load_state_dict", "hold", "release", "kv_dropped"]


def close(rollout, clock):
    """Held requests resolve when their engine closes, on the clock's ticks: the clock stops last."""
    async def stop():
        rollout.stepper.cancel()
        await rollout.pool.pool.close()
        clock.stop()
    try:
        rollout.pool.call(stop(), "closing the engines", 30)
    finally:
        rollout.pool.loop.stop()


def watch(ctl, calls: list) -> None:
    """Record the thread of every call of the controller's public methods."""
    for name in PUBLIC:
        method = getattr(ctl, name)

        def wrapped(*args, _method=method, _name=name, **kw):
            calls.append((_name, threading.current_thread().name))
            return _method(*args, **kw)
        setattr(ctl, name, wrapped)


def train_steps(rollout, steps: int) -> None:
    """What train.py's driver does each step (async + keep): round, pending, prefetch, store the
    carry's l_old, push the weights, now and then a checkpoint."""
    for step in range(steps):
        samples, metrics = rollout.round(step)
        assert len(samples) == 12 and "carried_samples" in metrics
        partials = rollout.pending()
        rollout.prefetch(step + 1)
        rollout.store([[-0.5] * len(s.response_ids) for s in partials])
        rollout.pool.call(rollout.pool.pool.reload_weights("/w", step + 1), "pushing weights")
        if step % 2:
            rollout.state_dict()


def test_the_driver_uses_the_controller_on_the_loop_thread_only():
    rollout, clock = open_rollout("keep")
    calls = []
    watch(rollout.controller, calls)
    try:
        train_steps(rollout, 4)
        state = rollout.state_dict()
    finally:
        close(rollout, clock)
    fresh, clock = open_rollout("keep")
    watch(fresh.controller, calls)
    try:
        fresh.load_state_dict(state)
        fresh.pool.call(fresh.pool.pool.reload_weights("/w", 4), "pushing weights")
        fresh.round(4)
    finally:
        close(fresh, clock)
    names = {n for n, _ in calls}
    assert {"run_round", "metrics", "pending_old_logprobs", "state_dict", "load_state_dict"} <= names
    off_loop = [(n, t) for n, t in calls if t != LOOP_THREAD]
    assert not off_loop, f"controller methods called off its loop thread: {sorted(set(off_loop))}"


def test_a_call_from_another_thread_while_its_loop_runs_is_refused():
    """The controller keeps the promise itself: a public method called from a thread other than
    its loop's, while that loop runs, raises naming the rule (a test or a new caller that reads
    it cross-thread fails at once, not once in a while)."""
    rollout, clock = open_rollout("keep")
    try:
        rollout.round(0)
        ctl: PartialRolloutController = rollout.controller
        for call in (ctl.metrics, ctl.pending_old_logprobs, ctl.state_dict, ctl.take_ready):
            with pytest.raises(RuntimeError, match="event loop's thread"):
                call()

        async def on_loop():
            return ctl.metrics()
        assert "carried_samples" in rollout.pool.call(on_loop(), "reading metrics")
    finally:
        close(rollout, clock)
