"""A request the engine refuses as invalid (RequestError: a prompt longer than its max_model_len,
...) in a partial-rollout round, on scripted engines.

The engine is healthy and the request's own fault: no engine is retired, nothing is retried
(the same request would be refused again) and the round goes on. The sample ends refused
(finish_reason "refused", as the sync rollout's): it scores 0 without the verifier (an
episode's environment rewards are not kept), its group trains as usual, and the round counts
it. A round whose every trained sample was refused has nothing to train on and stops the run
with the engine's message.
"""
import asyncio
import re

import pytest
from scripted_engine import Clock
from test_episodes import drive as drive_episodes
from test_rollout_stress import PROMPT, WorkloadEngine

from megarl.rollout.controller.partial import PartialRolloutController
from megarl.rollout.engines.engine import RequestError
from megarl.rollout.engines.pool import EnginePool


def lengths(gid: int, index: int) -> int:
    return 3 + (gid + index) % 4


def key_of(req) -> tuple[int, int]:
    return tuple(map(int, re.match(r"g(\d+)s(\d+)a\d+", req.key).groups()))


async def rounds(refuse, count=3, target=2, n=4):
    clock = Clock()
    clock.start()
    engines = [WorkloadEngine(f"e{i}", clock, lengths) for i in range(2)]
    for e in engines:
        e.refuse = refuse
    pool = EnginePool(engines, 30, failures_max=0)
    ctl = PartialRolloutController(
        pool, n=n, concurrency=6, max_new_tokens=64, temperature=1.0, max_staleness=4,
        new_group=lambda: ({}, list(PROMPT)), score=lambda s: 1.0 + len(s.response_ids), seed=0)
    trained, metrics = [], []
    try:
        for k in range(count):
            trained.append(await ctl.run_round(target, k))
            ctl.take_ready()
            metrics.append(ctl.metrics())
            await pool.reload_weights("/w", k + 1)
    finally:
        clock.stop()
    return ctl, trained, metrics


def test_a_refused_request_fails_its_sample_not_the_round():
    """Engine refusal of sample 2 of group 1: group 1 trains with that sample refused (no
    token, reward 0, the verifier not asked), its siblings scored as usual; every round trains
    its groups; no engine retired; the refusal asked once and counted."""
    def refuse(req):
        return "The decoder prompt is longer than the maximum model length" if key_of(req) == (1, 2) else None
    ctl, trained, metrics = asyncio.run(rounds(refuse))
    assert [len(gs) for gs in trained] == [2, 2, 2]
    assert ctl.pool.failures == [] and len(ctl.pool.engines) == 2
    assert sum(e.refused for e in ctl.pool.engines) == 1            # not retried
    assert sum(m["refused_samples"] for m in metrics) == 1
    [g1] = [g for gs in trained for g in gs if g.gid == 1]
    samples = ctl.samples_of(g1)
    assert samples[2].finish_reason == "refused" and samples[2].response_ids == [] and samples[2].reward == 0.0
    for i in (0, 1, 3):
        assert samples[i].finish_reason == "stop" and samples[i].reward == 1.0 + lengths(1, i)


def test_a_round_whose_every_sample_is_refused_stops_with_the_engines_message():
    def refuse(req):
        return "The decoder prompt (length 9000) is longer than the maximum model length of 4096"
    with pytest.raises(RequestError, match="refused every sample.*maximum model length"):
        asyncio.run(rounds(refuse, count=1))


def test_a_refused_episode_turn_ends_the_episode_with_reward_0():
    """An episode's second model turn is refused (its context grew past the engine's limit):
    the episode ends refused with reward 0 (not the environment's reward so far), its group
    trains, the run goes on."""
    def refuse(req):
        gid, index = key_of(req)
        observations = sum(1 for t in req.prompt_ids if 500 <= t < 1000)
        return "prompt too long" if (gid, index) == (1, 1) and observations else None
    ctl, trained, metrics, _ = asyncio.run(drive_episodes(3, refuse=refuse))
    assert sum(m["refused_samples"] for m in metrics) == 1
    [g1] = [g for _, gs in trained for g in gs if g.gid == 1]
    s = g1.slots[1]
    assert g1.record["turns"] == 2 and s.turns == 1 and s.env_reward == 0.0
    assert s.finish_reason == "refused" and g1.rewards[1] == 0.0
    assert g1.rewards[0] == 2.0
    assert ctl.pool.failures == []
