"""The intra-step overlap's pass cache and protocol (megarl/ppo/overlap.py), one process.

The pass here is a stand-in for a model's forward (values computed from the tokens, calls
counted); the real passes at real layouts are tests/dist/test_overlap.py."""
from dataclasses import replace

import pytest
import torch

from megarl.data.sample import Sample
from megarl.metrics.step import trainer_idle_frac
from megarl.ppo import overlap as ov
from megarl.ppo.batch import build_batch
from megarl.ppo.step import Pass


@pytest.fixture(autouse=True)
def one_rank(monkeypatch):
    """DP = 1 without initialising megatron's parallel state."""
    from megarl.distributed import parallel
    monkeypatch.setattr(parallel, "dp_size", lambda: 1)
    monkeypatch.setattr(parallel, "dp_rank", lambda: 0)


def group(uid: int, lengths, first: int = 10) -> list[Sample]:
    return [Sample([1, 2, uid % 50 + 3], [first + j + i for j in range(n)], [-1.0] * n, [0] * n, True, 0, uid=uid)
            for i, n in enumerate(lengths)]


class Counting:
    """A pass whose value at response token j is the token id + 1000 * (the batch's L): it
    shows whether a row was computed in its group's own layout."""

    def __init__(self, name="logp", versioned=True):
        self.calls = []
        self.p = Pass(name, None, self.fn, versioned=versioned)

    def fn(self, model, batch, mbs):
        self.calls.append(batch.size)
        L = batch.tokens.shape[1]
        targets = batch.tokens.gather(1, (batch.resp_index + 1).clamp(max=L - 1))
        return (targets.float() + 1000.0 * L) * batch.resp_mask


def test_row_keys_and_groups_follow_the_group_order():
    samples = group(7, [2, 3]) + group(5, [1, 1, 4])
    assert ov.row_keys(samples) == [(7, 0), (7, 1), (5, 0), (5, 1), (5, 2)]
    assert ov.groups_of(samples) == [[0, 1], [2, 3, 4]]


def test_cache_rejects_another_version_other_tokens_and_other_rows():
    versioned, frozen = Counting("logp").p, Counting("ref", versioned=False).p
    cache = ov.PassCache()
    s = group(3, [4])[0]
    cache.put(versioned, 2, (3, 0), s, torch.ones(4))
    cache.put(frozen, 2, (3, 0), s, torch.ones(4))
    assert cache.get(versioned, 2, (3, 0), s) is not None
    assert cache.get(versioned, 3, (3, 0), s) is None            # the weights moved on
    assert cache.get(frozen, 3, (3, 0), s) is not None           # the reference did not
    assert cache.get(versioned, 2, (3, 1), s) is None            # another sample of the group
    assert cache.get(versioned, 2, (4, 0), s) is None            # another group
    longer = group(3, [5])[0]                                    # same uid, other tokens (restarted)
    assert cache.get(versioned, 2, (3, 0), longer) is None
    assert cache.get(frozen, 2, (3, 0), longer) is None


def test_after_update_keeps_only_frozen_values_of_waiting_groups():
    versioned, frozen = Counting("logp").p, Counting("ref", versioned=False).p
    cache = ov.PassCache()
    for uid in (1, 2):
        s = group(uid, [2])[0]
        cache.put(versioned, 0, (uid, 0), s, torch.ones(2))
        cache.put(frozen, 0, (uid, 0), s, torch.ones(2))
    cache.after_update({2})
    assert len(cache) == 1
    assert cache.get(frozen, 1, (2, 0), group(2, [2])[0]) is not None


def test_forward_uses_matching_rows_and_computes_the_rest_group_by_group():
    c = Counting()
    o = ov.Overlap([c.p], pad_id=0, multiple=1, micro_batch_size=2)
    a, b, extra = group(1, [2, 6]), group(2, [3, 1]), group(9, [30, 30])
    o._compute([a, extra], version=4)     # emitted during the round: a (trained) and extra (not)
    assert c.calls == [2, 2]
    c.calls.clear()
    step = b + a                          # the step trains b, then a
    batch = build_batch(step, 0)
    got = o.forward(step, batch, 4)(c.p)
    assert c.calls == [2]                 # b only, alone
    for i, s in enumerate(step):          # each row in its own group's layout, not the batch's
        L = len(s.prompt_ids) + max(len(x.response_ids) for x in (b if s.uid == 2 else a))
        n = len(s.response_ids)
        want = torch.tensor(s.response_ids, dtype=torch.float) + 1000.0 * L
        assert torch.equal(got[i, :n], want) and not got[i, n:].any(), i
    assert o.after_update(step)["overlap_rows"] == 0.5
    # one row of a with other tokens (its group restarted): the whole group is computed again
    changed = [*b, a[0], replace(a[1], response_ids=a[1].response_ids[:-1] + [99])]
    o.forward(changed, build_batch(changed, 0), 4)(c.p)
    assert c.calls[-2:] == [2, 2] and o.after_update(changed)["overlap_rows"] == 0.0
    o._compute([a], version=4)
    # new weights: a's values are stale, the whole step is computed again
    calls = len(c.calls)
    o.forward(step, batch, 5)(c.p)
    assert len(c.calls) == calls + 2 and o.after_update(step)["overlap_rows"] == 0.0


def test_serve_broadcasts_each_new_group_once_and_ends_on_done():
    c = Counting()
    o = ov.Overlap([c.p], pad_id=0, multiple=1, micro_batch_size=4)
    groups = {1: group(1, [2, 2]), 2: group(2, [3, 3]), 3: group(3, [1, 4])}
    o._compute([groups[3]], version=0)    # already known (e.g. from an earlier poll)
    c.calls.clear()
    shown = [[], [1], [1, 3], [1, 3], [1, 2, 3]]
    polls = {"n": -1}

    def finished(timeout):
        polls["n"] += 1
        return polls["n"] == len(shown) - 1

    def emitted(seen):
        now = shown[polls["n"]]
        return now, [groups[u] for u in now if u not in seen]
    seconds = o.serve(0, finished, emitted)
    assert c.calls == [2]                 # group 1 once; 3 was cached; 2 came only at the end
    assert seconds >= 0 and o.seconds == seconds
    assert o._live == {1, 2, 3}
    o.after_update(groups[1])             # 1 trained; 2, 3 wait (their versioned values drop)
    assert len(o.cache) == 0


def test_serve_sends_at_most_a_few_groups_between_looks_at_the_round(monkeypatch):
    sent = []
    monkeypatch.setattr(ov, "from_rank0", lambda m: sent.append(m) or m)
    o = ov.Overlap([Counting().p], pad_id=0, multiple=1, micro_batch_size=4)
    groups = [group(u, [2, 3]) for u in range(6)]
    looks = {"n": 0}

    def finished(timeout):
        looks["n"] += 1
        return looks["n"] > 3

    def emitted(seen):
        return [g[0].uid for g in groups], [g for g in groups if g[0].uid not in seen]
    o.serve(0, finished, emitted)
    assert [m[0] for m in sent] == ["groups", "groups", "done"]
    assert [len(m[1]) for m in sent[:2]] == [ov.GROUPS_PER_MESSAGE, 6 - ov.GROUPS_PER_MESSAGE]


def test_trainer_idle_frac_counts_overlapped_passes_as_work():
    assert trainer_idle_frac(2.0, 10.0) == pytest.approx(0.8)
    assert trainer_idle_frac(2.0, 10.0, overlap_s=3.0) == pytest.approx(0.5)
