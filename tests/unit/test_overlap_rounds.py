"""The driver's side of the intra-step overlap (`Rollout.round(step, during)`, rounds.py): while
a partial round runs on the loop thread, `during` sees the groups complete and scored so far,
each only with the tokens it is then trained with. One component with the scripted engines of
test_async_checkpoint (the trainer's side on real ranks: tests/dist/test_overlap.py)."""
from test_async_checkpoint import close, open_rollout

from megarl.rollout.controller.slots import Group, Slot


class Watch:
    """A `during` that polls like `Overlap.serve` and keeps what it saw."""

    def __init__(self):
        self.samples, self.polls, self.live, self.offered = {}, [], [], []

    def __call__(self, finished, emitted):
        seen = set()
        while not finished(0.001):
            uids, fresh = emitted(seen)
            if not finished(0):   # read while the round ran (once it ends, it takes its groups)
                self.polls.append(len(uids))
            self.offered.append(len(fresh))
            for g in fresh:
                assert len(g) == 4 and all(s.finish_reason in ("stop", "length") for s in g)
                self.samples[g[0].uid] = [(s.prompt_ids, s.response_ids, s.reward) for s in g]
                seen.add(g[0].uid)
        self.live = emitted(seen)[0]


def test_during_sees_scored_groups_with_the_tokens_they_are_trained_with():
    rollout, clock = open_rollout()
    try:
        for step in (0, 1):
            watch = Watch()
            samples, _ = rollout.round(step, watch)
            rollout.prefetch(step + 1)
            trained = {}
            for s in samples:
                trained.setdefault(s.uid, []).append((s.prompt_ids, s.response_ids, s.reward))
            # at the end the round's groups are taken: what `emitted` lists then waits for a later step
            assert len(trained) == 3 and not set(trained) & set(watch.live)
            # round 0 starts with the call (round 1 was prefetched and may be over by now)
            assert watch.samples or step == 1, "no group was complete before the round ended"
            for uid, rows in watch.samples.items():   # what `during` saw of a trained group is what trains
                if uid in trained:
                    assert rows == trained[uid], uid
            assert watch.polls or step == 1, "no poll landed while round 0 ran"
            assert watch.polls == sorted(watch.polls)   # groups only accumulate while the round runs
            assert max(watch.offered, default=0) <= 3   # groups_per_step: what this step can still take
    finally:
        rollout.stepper.cancel()
        close(rollout, clock)


def test_emitted_offers_only_what_the_step_can_still_take_in_its_order():
    """Complete groups 5, 2, 9, 1 and 7 (due at step 4): the step takes 7, then 1 and 2
    (groups_per_step=3); 5 and 9 come after them, and any group completing later can only go
    before them, so only 7, 1, 2 are offered, in that order. Every uid is listed. With group 0
    open and due, the round waits for it and the step takes it before 2: 2 is not offered."""
    rollout, clock = open_rollout()
    try:
        def group(gid, deadline=None):
            slots = [Slot(gid, i, 0, [3, 4], [-1.0, -1.0], [0, 0], finish_reason="stop") for i in range(4)]
            return Group(gid, {}, [7, 7], slots, True, [0.0] * 4, deadline)

        async def fill():
            rollout.controller.completed = [group(5), group(2), group(9), group(1), group(7, deadline=4)]
        rollout.pool.call(fill(), "setting groups")
        uids, fresh = rollout.pool.call(rollout._emitted(set(), 4), "reading")
        assert sorted(uids) == [1, 2, 5, 7, 9]
        assert [g[0].uid for g in fresh] == [7, 1, 2]
        _, fresh = rollout.pool.call(rollout._emitted({7, 1}, 4), "reading")
        assert [g[0].uid for g in fresh] == [2]

        async def open_groups():   # still generating: 0 is due at step 4 (the round waits for it), 3 is not
            rollout.controller.groups = {0: group(0, deadline=4), 3: group(3)}
        rollout.pool.call(open_groups(), "opening groups")
        uids, fresh = rollout.pool.call(rollout._emitted(set(), 4), "reading")
        assert sorted(uids) == [1, 2, 5, 7, 9] and [g[0].uid for g in fresh] == [7, 1]   # 0 goes before 2
    finally:
        close(rollout, clock)
