"""Elastic steps (rollout.partial.max_step_multiple): at a bounded staleness a step trains
every complete group it may, in whole multiples of train.groups_per_step, so the engines stay
full while a due sample finishes; every trained token stays within the bound and long samples
are trained as often as the sync rollout trains them."""
import asyncio

import pytest
from test_rollout_stress import WorkloadEngine, bimodal, drive, has_long, long_tail, sync_share

from megarl.rollout.controller.staleness import round_may_end, step_groups


def test_step_groups_covers_every_due_group_in_whole_multiples():
    # (complete, due, per_step, cap) -> groups the step trains
    assert step_groups(3, 0, 3, 3) == 3              # fixed steps: exactly per_step
    assert step_groups(11, 0, 3, 12) == 9            # whole multiples only
    assert step_groups(20, 0, 3, 12) == 12           # at most the cap
    assert step_groups(7, 4, 3, 12) == 6             # the 4 due ones and 2 more: a whole multiple
    assert step_groups(20, 14, 3, 12) == 15          # more due than the cap (a restored carry): all of them


def test_a_round_ends_only_with_a_whole_multiple_covering_the_due_groups():
    assert not round_may_end(2, 0, 0, 3)             # fewer than per_step complete
    assert round_may_end(3, 0, 0, 3)
    assert not round_may_end(5, 4, 0, 3)             # 4 due complete: the step needs 6
    assert round_may_end(6, 4, 0, 3)
    assert not round_may_end(9, 1, 1, 3)             # a due group still open


@pytest.mark.parametrize("multiple", [0, -2])
def test_a_step_multiple_below_one_is_refused_not_clamped(multiple):
    """A controller built outside the schema (the simulator, the bench) gets the schema's rule:
    a clamp to 1 would run fixed steps where the caller asked for something else."""
    from scripted_engine import Clock

    from megarl.rollout.controller.partial import PartialRolloutController
    from megarl.rollout.engines.pool import EnginePool
    pool = EnginePool([WorkloadEngine("e0", Clock(), bimodal)], 30)
    with pytest.raises(ValueError, match=rf"rollout.partial.max_step_multiple={multiple}: must be >= 1"):
        PartialRolloutController(pool, n=2, concurrency=4, max_new_tokens=8, temperature=1.0, max_staleness=2,
                                 stale_policy="finish", new_group=lambda: ({}, [7, 7]), score=lambda s: 0.0,
                                 seed=0, step_multiple=multiple)


@pytest.mark.parametrize("length_of", [bimodal, long_tail], ids=["bimodal", "long_tail"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["partial", "async"])
def test_elastic_steps_keep_the_engines_full_within_the_bound(length_of, asynchronous):
    """At max_staleness=2 with fixed steps the engines ran 6-10 of 32 requests on these
    workloads (docs/partial_rollout.md); with elastic steps they stay near 32, and every
    trained token is still within the bound, nothing is restarted, every group is trained
    once, and the long-sample share is the sync rollout's within 10%. (A cap of 16 steps'
    groups: a long sample here is 5-20 times the others, and the steps are 12 samples
    against 32 in flight.)"""
    rounds, target, multiple, S = 20, 3, 16, 2
    from scripted_engine import Clock
    clock = Clock()
    ctl, trained, metrics = asyncio.run(drive(length_of, rounds, max_staleness=S, asynchronous=asynchronous,
                                              step_multiple=multiple, clock=clock))
    groups = [g for _, gs in trained for g in gs]
    assert len({g.gid for g in groups}) == len(groups) > rounds * target
    for k, gs in trained:
        assert len(gs) % target == 0 and target <= len(gs) <= multiple * target, (k, len(gs))
        for g in gs:
            for s in g.slots:
                assert s.restarts == 0 and s.done
                assert all(k - v <= S for v in s.versions), (k, s.versions)
    want = sync_share(length_of, len(groups))
    share = sum(map(has_long, groups)) / len(groups)
    assert abs(share - want) <= 0.1 * want, (share, want)
    busy = [r for r, pending in zip(clock.running_total, clock.pending) if pending]
    assert sum(busy) / len(busy) >= 0.9 * 32, sum(busy) / len(busy)
    assert sum(m["groups_trained"] for m in metrics) == len(groups)
    assert all(m["rollout_slots_used"] <= 1.0 for m in metrics)


def test_a_larger_step_makes_more_updates_of_the_same_size():
    from megarl.ppo.step import mini_batch_count
    assert mini_batch_count(2, 64, 64) == 2           # a fixed step: train.mini_batches
    assert mini_batch_count(2, 64, 192) == 6          # three times the groups: three times the updates of 32
    assert mini_batch_count(4, 512, 1024) == 8
    assert mini_batch_count(2, 64, 48) == 2           # fewer rows (not an elastic step): as configured


def test_fixed_steps_leave_the_engines_idle_at_the_same_bound():
    """The defect elastic steps remove: with a step of exactly train.groups_per_step groups the
    staleness window fills and admission waits while a due long sample finishes."""
    from scripted_engine import Clock
    clock = Clock()
    asyncio.run(drive(long_tail, 12, max_staleness=2, step_multiple=1, clock=clock))
    busy = [r for r, pending in zip(clock.running_total, clock.pending) if pending]
    assert sum(busy) / len(busy) < 0.5 * 32
