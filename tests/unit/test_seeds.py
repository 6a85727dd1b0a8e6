"""The seed formulas (megarl/data/seeds.py) pinned to their values: a seeded run's rewards
are compared bitwise across versions, so a formula may not change by accident. The values
were computed with the formulas as they stood in each caller before they moved here."""
from megarl.data import seeds
from megarl.data.prompts import PromptSampler
from megarl.rollout.controller.partial import PartialRolloutController
from megarl.rollout.controller.sync_rollout import group_requests


def test_step_prompt_seeds():
    assert seeds.step_prompt_seeds(7, 3, 4) == [7030042, 7030043, 7030044, 7030045]
    assert seeds.step_prompt_seeds(2**40, 12345, 2) == [635537951, 635537952]   # reduced mod 2**31 - 1


def test_group_and_sample_seeds():
    assert seeds.group_seed(7, 41) == 7410308
    assert seeds.group_seed(2**40, 9) == 512091599
    assert seeds.sample_seed(7030042, 2) == 7030042002


def test_request_seed():
    assert seeds.request_seed(123456789012, 17, 2) == 1701409424
    assert seeds.request_seed(5, 0, 0) == 5000015


def test_shuffle_seeds():
    assert seeds.epoch_shuffle_seed(7, 2) == 7000023
    assert seeds.minibatch_seed(7, 5) == 55438


def test_callers_draw_the_pinned_seeds():
    """The sync rollout's requests and the prompt sampler's order, as before the move."""
    reqs = group_requests([[1], [2]], 3, 5, 1.0, seeds.step_prompt_seeds(7, 3, 2))
    assert [r.seed for r in reqs] == [7030042000, 7030042001, 7030042002, 7030043000, 7030043001, 7030043002]
    assert PromptSampler(10, 7).take(15) == [0, 6, 9, 7, 5, 1, 4, 8, 3, 2, 5, 9, 0, 1, 7]


class _NoPool:
    holders, engines, version = [], [], 0


def test_partial_rollout_draws_the_pinned_seeds():
    """Group 41 of run seed 7: its slots' base seeds, the first request's seed, and the seed
    after 17 tokens and 2 restarts, as the controller computed them before the move."""
    ctl = PartialRolloutController(_NoPool(), n=3, concurrency=1, max_new_tokens=64, temperature=1.0,
                                   max_staleness=1, new_group=lambda: ({}, [1, 2]), score=lambda s: 0.0,
                                   seed=7, stale_policy="restart")
    ctl.next_gid = 41
    group = ctl._open_group()
    assert [s.seed for s in group.slots] == [7410308000, 7410308001, 7410308002]
    slot = group.slots[1]
    assert ctl._request(slot).seed == 1968770162
    slot.response_ids, slot.restarts = [5] * 17, 2
    assert ctl._request(slot).seed == 1969114243
