"""Observation tokens of multi-turn episodes against the staleness bound and the token budget,
on the scripted engines of test_episodes.

Observation tokens are context the environment appended (mask 0): they carry the version of the
turn they answer (the first observation, `reset`'s, the version the episode started under) and
never make a sample stale. An observation that leaves no room in the token budget (the first
one, or any later one) ends its episode, cut by the budget; the round goes on.
"""
import asyncio
import re

import pytest
from test_episodes import OBS0, CountingEnv, WordTokenizer, drive

from megarl.envs.episodes import EpisodeDriver
from megarl.rollout.controller import staleness
from megarl.rollout.controller.slots import Group, Slot


class FirstObservationEnv(CountingEnv):
    """CountingEnv whose reset answers a first observation ("o0": two tokens)."""

    async def reset(self, record):
        await super().reset(record)
        return "o0"


def runs(mask):
    """[start, end) of each maximal run of observation tokens."""
    out, start = [], None
    for i, m in enumerate([*mask, 1]):
        if not m and start is None:
            start = i
        elif m and start is not None:
            out.append((start, i))
            start = None
    return out


def model_versions(s):
    return [v for v, m in zip(s.versions, s.mask) if m]


@pytest.mark.parametrize("policy", ["finish", "restart"])
def test_a_first_observation_never_makes_an_episode_stale(policy):
    """max_staleness=1, episodes that start with reset's observation, 8 rounds: finish restarts
    nothing (a restart there only repairs a restored carry past the bound); restart restarts
    only samples whose model tokens are past the bound. Every trained sample keeps the bound
    on its model tokens, and each observation's version is the turn's it answers."""
    restarts, holder = [], {}
    original = Slot.restart

    def recording(self):
        step = holder["ctl"]._train_version
        restarts.append((step, model_versions(self) if self.mask else list(self.versions)))
        return original(self)

    def keep(ctl, version):
        holder["ctl"] = ctl
    Slot.restart = recording
    try:
        _, trained, metrics, _ = asyncio.run(drive(8, env=FirstObservationEnv, policy=policy, max_staleness=1,
                                                   on_round=keep))
    finally:
        Slot.restart = original
    if policy == "finish":
        assert sum(m["restarted_samples"] for m in metrics) == 0, [m["restarted_samples"] for m in metrics]
        assert sum(m["stale_tokens_discarded"] for m in metrics) == 0
    for step, versions in restarts:   # restart: only what the model produced can be past the bound
        assert versions and step - min(versions) > 1, (step, versions)
    for version, groups in trained:
        for g in groups:
            for s in g.slots:
                mv = model_versions(s)
                assert mv and version - min(mv) <= 1, (version, s.versions)
                first, *later = runs(s.mask)
                assert first[0] == 0 and s.response_ids[:2] == [OBS0, OBS0]   # reset's observation
                # the version the episode started under (test below): no later than its first model token's
                assert s.versions[0] <= mv[0] and len(set(s.versions[first[0]:first[1]])) == 1
                for a, b in later:             # a step's observation: the version of the turn it answers
                    assert s.versions[a:b] == [s.versions[a - 1]] * (b - a), (s.versions, s.mask)


def test_the_staleness_rules_read_model_tokens_only():
    """An observation token of an old version (a checkpoint of the old stamping) makes no
    sample stale, under restart / drop and under finish's deadlines."""
    def group():
        s = Slot(0, 0, 0, [500, 500, 1002, 1003], [0.0, 0.0, -0.1, -0.1], [0, 0, 5, 5],
                 mask=[0, 0, 1, 1])
        return Group(0, {}, [7, 7], [s])
    assert staleness.stale_slots(group(), 6, 1) == []
    assert staleness.stale_slots(group(), 7, 1) != []          # the model tokens' own age still counts
    groups = {0: group()}
    _, lost = staleness.discard_stale(groups, [], 6, 1, drop=False)
    assert lost.restarted == 0 and groups[0].slots[0].response_ids
    groups = {0: group()}
    _, lost = staleness.check_deadlines(groups, [], 6, 6, 1, per_step=2)
    assert lost.restarted == 0 and groups[0].deadline == 6


class LongTokenizer(WordTokenizer):
    """WordTokenizer; "long<n>" encodes as n observation tokens."""

    def __call__(self, text, add_special_tokens=False):
        m = re.fullmatch(r"long(\d+)", text)
        return {"input_ids": [OBS0 + 9] * int(m.group(1))} if m else super().__call__(text)


class LongFirstObservationEnv(CountingEnv):
    """Group 1's episodes start with a first observation of 40 tokens; group 2's answer their
    first turn with one of 40; the others are CountingEnv's."""

    async def reset(self, record):
        await super().reset(record)
        return "long40" if record["gid"] == 1 else None

    async def step(self, turn):
        res = await super().step(turn)
        if self.record["gid"] == 2 and not res.done:
            res.observation = "long40"
        return res


def test_an_observation_longer_than_the_budget_ends_its_episode_not_the_round():
    """rollout.sampling.max_new_tokens=30: group 1's first observation (40 tokens) leaves no
    room for a model token, group 2's second one neither: both end, cut by the budget, their
    tokens within it (group 1 scored 0: the environment never stepped); every round goes on and
    trains its groups, the others' episodes whole."""
    _, trained, metrics, _ = asyncio.run(drive(4, env=LongFirstObservationEnv, max_new=30, target=2,
                                               tokenizer=LongTokenizer()))
    seen = {}
    for _, groups in trained:
        assert len(groups) == 2
        for g in groups:
            seen[g.gid] = g
            for s in g.slots:
                assert s.done and len(s.response_ids) <= 30, (g.gid, len(s.response_ids))
    assert {1, 2} <= set(seen)
    for s in seen[1].slots:
        assert s.finish_reason == "length" and 1 not in s.mask and s.turns == 0
    assert seen[1].rewards == [0.0] * len(seen[1].slots)
    two = [s for s in seen[2].slots if seen[2].record["turns"] > 1]
    for s in two:
        assert s.finish_reason == "length" and s.turns == 1 and OBS0 + 9 not in s.response_ids
    # (other episodes may end at the budget too: a short observation with no room after it)
    assert sum(m["env_budget_ends"] for m in metrics) >= len(seen[1].slots) + len(two)


def test_a_first_observation_carries_the_version_the_episode_starts_under():
    driver = EpisodeDriver(type("Spec", (), {"name": "first", "factory": FirstObservationEnv})(), WordTokenizer(),
                           max_turns=3, timeout_s=5)
    slot = Slot(0, 0, 0)
    try:
        asyncio.run(driver.ensure(slot, Group(0, {"turns": 2}, [7], [slot]), budget=12, version=3))
    finally:
        driver.close()
    assert slot.response_ids == [OBS0, OBS0] and slot.mask == [0, 0] and slot.versions == [3, 3]
    assert slot.turn_base == 2 and not slot.done


def test_an_episode_driver_ends_an_episode_whose_first_observation_fills_the_budget():
    """EpisodeDriver.ensure with a budget the first observation does not fit: the episode is
    done (cut by the budget) with no token past it, and counted."""
    class Env(CountingEnv):
        async def reset(self, record):
            return "long12"
    driver = EpisodeDriver(type("Spec", (), {"name": "long", "factory": Env})(), LongTokenizer(),
                           max_turns=3, timeout_s=5)
    slot = Slot(0, 0, 0)
    try:
        asyncio.run(driver.ensure(slot, Group(0, {}, [7], [slot]), budget=12, version=3))
    finally:
        driver.close()
    assert slot.done and slot.finish_reason == "length" and slot.response_ids == []
    assert driver.take_metrics()["env_budget_ends"] == 1
