"""The driver's side of the intra-step overlap (`Rollout.round(step, during)`, rounds.py): while
a partial round runs on the loop thread, `during` sees the groups complete and scored so far,
each only with the tokens it is then trained with. One component with the scripted engines of
test_async_checkpoint (the trainer's side on real ranks: tests/dist/test_overlap.py)."""
from test_async_checkpoint import close, open_rollout


class Watch:
    """A `during` that polls like `Overlap.serve` and keeps what it saw."""

    def __init__(self):
        self.samples, self.polls, self.live = {}, [], []

    def __call__(self, finished, emitted):
        seen = set()
        while not finished(0.001):
            uids, fresh = emitted(seen)
            self.polls.append(len(uids))
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
            assert watch.polls == sorted(watch.polls)   # groups only accumulate while the round runs
    finally:
        rollout.stepper.cancel()
        close(rollout, clock)
