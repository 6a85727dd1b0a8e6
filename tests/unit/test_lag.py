"""rollout.lag's queue (megarl/rollout/controller/lag.py): how many rounds a step generates, which one it
trains, and that a checkpoint of the queue restores it exactly."""
import io

import pytest
import torch

from megarl.data.sample import Sample
from megarl.rollout.controller.lag import LagQueue


def round_of(tag: int, n: int = 2, with_old: bool = True) -> list[Sample]:
    out = []
    for i in range(n):
        resp = [tag, i + 5]
        out.append(Sample([1, 2], resp, [-0.5, -0.25], [tag, tag], True, i, {"q": tag},
                          old_logprobs=[-0.5, -0.125] if with_old else [], uid=tag * 10 + i))
    return out


def test_the_first_step_fills_k_plus_one_rounds_then_one_per_step():
    q = LagQueue(3)
    assert q.missing() == 4
    for k in range(4):
        q.put(round_of(k), {"round": k})
    assert q.missing() == 0
    samples, metrics = q.take()
    assert metrics == {"round": 0} and [s.uid for s in samples] == [0, 1]   # the oldest first
    assert q.missing() == 1
    q.put(round_of(4), {"round": 4})
    assert q.take()[1]["round"] == 1 and q.missing() == 1


def test_lag_zero_trains_each_round_at_once():
    q = LagQueue(0)
    assert q.missing() == 1
    q.put(round_of(0), {})
    assert q.take()[0][0].uid == 0 and q.missing() == 1


def test_a_round_without_trainer_logprobs_is_refused():
    """A queued round trained later under other weights needs its l_old from now: refusing it
    here keeps a stale token from silently getting the later weights' logprob."""
    with pytest.raises(ValueError, match="lacks the trainer's logprobs"):
        LagQueue(2).put(round_of(0, with_old=False), {})


def test_taking_before_the_queue_is_full_is_an_error():
    q = LagQueue(2)
    q.put(round_of(0), {})
    with pytest.raises(RuntimeError, match="rollout.lag=2: 1 rounds queued, the step needs 3"):
        q.take()


def test_state_round_trips_through_a_weights_only_checkpoint():
    q = LagQueue(2)
    q.put(round_of(0), {"reward_mean": 0.5})
    q.put(round_of(1), {"reward_mean": 0.25})
    q.put(round_of(2), {"reward_mean": 0.75})
    buf = io.BytesIO()
    torch.save(q.state_dict(), buf)
    buf.seek(0)
    back = LagQueue(2)
    back.load_state_dict(torch.load(buf, weights_only=True))   # plain lists, dicts and numbers only
    assert back.missing() == 0 and len(back.rounds) == 3
    a, b = q.take(), back.take()
    assert a == b and a[0][0].old_logprobs == [-0.5, -0.125] and a[0][0].record == {"q": 0}


def test_a_queue_resumed_with_a_smaller_lag_drains_without_losing_a_round():
    old = LagQueue(3)
    for k in range(4):
        old.put(round_of(k), {"round": k})
    q = LagQueue(1)
    q.load_state_dict(old.state_dict())
    got = []
    while q.missing() == 0:
        got.append(q.take()[1]["round"])
    assert got == [0, 1, 2] and q.missing() == 1   # round 3 stays queued, then one per step


def test_a_negative_lag_is_refused():
    with pytest.raises(ValueError, match="rollout.lag=-1"):
        LagQueue(-1)
