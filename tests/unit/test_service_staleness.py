"""rollout.mode=service keeps the staleness bound (rollout.partial.max_staleness), as the
partial-rollout controller does: what the service hands to a step holds no model token more
than max_staleness versions older than that step. A sample past it is not trained: its place
in the group is handed out again (stale_policy=drop: its whole group is dropped), counted.
The driver's `Rollout` over the agent service and a table engine (tests/unit/service_support.py).
"""
from types import SimpleNamespace

import pytest
from service_support import build_tokenizer
from test_service import FIRST, Harness

from megarl.rollout.controller.rounds import Rollout
from megarl.rollout.engines.pool import SyncPool


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def config(max_staleness: int, policy: str):
    return SimpleNamespace(
        rollout=SimpleNamespace(mode="service", sampling=SimpleNamespace(n=2, max_new_tokens=64, temperature=0.7),
                                group_filter="none", group_filter_max_draws=10,
                                partial=SimpleNamespace(max_staleness=max_staleness, stale_policy=policy,
                                                        asynchronous=False, concurrency=4)),
        train=SimpleNamespace(groups_per_step=1), service=SimpleNamespace(wait_s=10.0),
        run=SimpleNamespace(seed=0), env=SimpleNamespace(name=""),
        data=SimpleNamespace(prompt_key="prompt", messages_key="messages"))


def episode(h) -> dict:
    ep = h.open()
    h.chat(ep["episode_id"], FIRST)
    h.reward(ep["episode_id"], 1.0)
    return ep


@pytest.mark.parametrize("policy", ["finish", "restart", "drop"])
def test_a_step_takes_no_group_past_the_staleness_bound(tokenizer, policy):
    """Group 0 completes at version 0, group 1 at version 3. The step at version 3 with
    max_staleness=1 trains group 1 only: group 0's samples are restarted (their places handed
    out again: the next episodes are group 0's) or, with drop, the group is dropped (the next
    episode starts a new record); counted in the step's metrics."""
    h = Harness(tokenizer)
    try:
        first = [episode(h), episode(h)]
        assert {e["group"] for e in first} == {0}
        h.loop.run(h.pool.reload_weights("unused", 3), 10)
        assert {episode(h)["group"], episode(h)["group"]} == {1}
        rollout = Rollout(config(1, policy), SyncPool(h.pool, h.loop, 10), [], None, tokenizer, None,
                          service_factory=lambda next_task: h.service)
        samples, metrics = rollout.round(3)
        assert [s.uid for s in samples] == [101, 101]          # group 1's record
        assert all(v == 3 for s in samples for v in s.versions)
        restarted, dropped = (0, 1) if policy == "drop" else (2, 0)
        assert (metrics["agent_stale_restarted"], metrics["agent_stale_groups_dropped"]) == (restarted, dropped)
        assert metrics["agent_stale_tokens_discarded"] == sum(len(s.response_ids) for s in samples)   # same script
        nxt = h.open()
        assert (nxt["group"], nxt["index"]) == ((2, 0) if policy == "drop" else (0, 0))
    finally:
        h.close()


def test_groups_within_the_bound_are_taken_as_before(tokenizer):
    h = Harness(tokenizer)
    try:
        episode(h), episode(h)
        h.loop.run(h.pool.reload_weights("unused", 2), 10)
        rollout = Rollout(config(2, "finish"), SyncPool(h.pool, h.loop, 10), [], None, tokenizer, None,
                          service_factory=lambda next_task: h.service)
        samples, metrics = rollout.round(2)
        assert [s.uid for s in samples] == [100, 100] and metrics["agent_stale_restarted"] == 0
    finally:
        h.close()
