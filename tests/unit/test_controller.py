"""The partial-rollout controller against scripted engines on a deterministic clock.

Pins the controller's contract: fixed concurrency, frontier-first admission, each group
emitted once, carry-over that loses and duplicates no token and keeps each token's version,
stitched old logprobs from the version that produced each token, the staleness bound, and
state that survives a save/restore mid-run.
"""
import asyncio
import re

import pytest
import torch
from scripted_engine import TOKEN0, Clock, ScriptedEngine, behaviour_logprob

from megarl.ppo.batch import build_batch, stitch_old_logprobs
from megarl.rollout.controller.partial import PartialRolloutController
from megarl.rollout.engines.engine import EngineError
from megarl.rollout.engines.pool import EnginePool

PROMPT_LEN = 2


def length_of(gid: int, index: int) -> int:
    """Long-tailed lengths: mostly short, every 7th sample long."""
    return 40 + 3 * gid if (gid * 4 + index) % 7 == 0 else 3 + (gid + index) % 5


def trainer_logprob(version: int, position: int) -> float:
    """What a 'trainer' at `version` says about the token at `position` (distinct per version)."""
    return -0.01 * (version + 1) - 1e-4 * position


class KeyedEngine(ScriptedEngine):
    """The scripted engine, with each sample's length read from its request key."""

    async def generate(self, req):
        gid, index = map(int, re.match(r"g(\d+)s(\d+)a\d+", req.key).groups())
        prompt = [gid, index, length_of(gid, index), *req.prompt_ids[PROMPT_LEN:]]
        return await super().generate(type(req)(req.key, prompt, req.max_tokens, req.temperature,
                                                req.top_p, req.seed))


class DyingKeyedEngine(KeyedEngine):
    """Dies at clock tick `at`: every request it runs then (and any later one) fails as a
    dead server's does, handing back the tokens it had streamed."""

    def __init__(self, name, clock, at):
        super().__init__(name, clock)
        self.at = at
        self.failed_with_tokens = 0   # requests that died holding streamed tokens

    async def generate(self, req):
        task = asyncio.ensure_future(super().generate(req))
        while not task.done() and self.clock.ticks < self.at:
            await self.clock.tick()
        if task.done() and self.clock.ticks < self.at:
            return task.result()
        if not task.done():
            await self.abort([req.key])
        self.failed_with_tokens += bool(task.result().token_ids)
        raise EngineError(f"engine {self.name}: connection lost", partial=task.result())


async def drive(rounds, *, concurrency=8, n=4, target=3, max_new=64, max_staleness=8,
                policy="restart", engines=2, state=None, start_version=0, on_round=None, die_at=None,
                update_mode="abort", keep_kv=False, between=None, scorer_of=None):
    """Run `rounds` rounds like the trainer would: round, store old logprobs, bump version.
    die_at: the clock tick at which engine e1 dies (the pool retires it and carries on).
    update_mode / keep_kv: the pool's (rollout.update_mode / rollout.keep_kv).
    between(ctl, version): awaited after each weight update (e.g. let held requests run).
    scorer_of(clock): the controller's `scorer` (default: scores on the loop, costing nothing)."""
    clock = Clock()
    clock.start()
    pool = EnginePool([DyingKeyedEngine(f"e{i}", clock, die_at) if die_at is not None and i == 1
                       else KeyedEngine(f"e{i}", clock) for i in range(engines)], 30, failures_max=1,
                      update_mode=update_mode, keep_kv=keep_kv)
    ctl = PartialRolloutController(
        pool, n=n, concurrency=concurrency, max_new_tokens=max_new, temperature=1.0,
        max_staleness=max_staleness, stale_policy=policy,
        new_group=lambda: ({"q": "x"}, [7, 7]), score=lambda s: float(len(s.response_ids)), seed=0,
        scorer=None if scorer_of is None else scorer_of(clock))
    # work is pending while a round runs and has not yet got its groups
    clock.is_pending = lambda: ctl._round_done is not None and not ctl._ending
    if state is not None:
        ctl.load_state_dict(state)
    version = start_version
    for e in pool.engines:
        e.version = version
    trained, metrics = [], []
    try:
        for _ in range(rounds):
            groups = await ctl.run_round(target, version)
            assert ctl.take_ready() == groups   # the driver takes them: the trainer's from now on
            trained.append((version, groups))
            metrics.append(ctl.metrics())
            # the trainer: l_old of this round's tokens, before its weights change
            for slot, restarts, length, _sample in ctl.pending_old_logprobs():
                ctl.store_old_logprobs(slot, restarts, length, [trainer_logprob(version, p) for p in range(length)])
            if on_round:
                on_round(ctl, version)
            version += 1
            await pool.reload_weights("/nowhere", version)
            if between:
                await between(ctl, version)
    finally:
        clock.stop()
    return ctl, trained, metrics, clock


def run(coro):
    return asyncio.run(coro)


def test_inflight_stays_at_the_concurrency_while_the_round_runs():
    """At every tick, exactly `concurrency` requests run across both engines (never more, never
    fewer while work is pending), and the two engines share them."""
    ctl, trained, metrics, clock = run(drive(4, concurrency=8))
    ticks = [c for c, pending in zip(clock.running_total, clock.pending) if pending]
    assert max(clock.running_total) == 8
    assert ticks.count(8) == len(ticks), sorted(set(ticks))
    assert all(m["rollout_inflight_min"] == 8 for m in metrics), metrics
    served = [e.served for e in ctl.pool.engines]
    assert min(served) > 0.4 * sum(served)


def test_a_slow_reward_leaves_the_slots_as_full_as_an_instant_one():
    """The run's reward runner with an async verifier that takes 40 clock ticks per sample: the
    engines' loop awaits it while it runs elsewhere, so at every tick of a round that still
    needs groups `concurrency` requests run, as with a reward that costs nothing, and a round
    waiting for its scores keeps the engines generating. The clock runs
    during the reward on purpose (no `holding()`): a reward that stalled the loop would stop
    the ticks' requests from being refilled and show as fewer running."""
    from types import SimpleNamespace

    from megarl.rewards import RewardRunner, VerifierEntry
    from megarl.rollout.controller.scoring import score_group
    tokenizer = SimpleNamespace(decode=lambda ids, **k: "t" * len(ids))
    runners = []

    def slow_scorer(clock):
        async def judge(response_text, record, *, finished):   # on the runner's own loop and thread
            until = clock.ticks + 40
            while clock.ticks < until:
                await asyncio.sleep(0.001)
            return float(len(response_text))
        runners.append(RewardRunner(VerifierEntry(judge, False, False), timeout_s=600, concurrency=64))
        return lambda samples: score_group(samples, tokenizer, runners[-1])

    results = {}
    try:
        for name, scorer_of in (("instant", None), ("slow", slow_scorer)):
            ctl, trained, metrics, clock = run(drive(3, concurrency=8, scorer_of=scorer_of))
            ticks = [c for c, pending in zip(clock.running_total, clock.pending) if pending]
            results[name] = (ticks, metrics, trained)
    finally:
        for r in runners:
            r.close()
    for name, (ticks, metrics, trained) in results.items():
        assert ticks and ticks.count(8) == len(ticks), (name, sorted(set(ticks)))
        # (absent from a round that had its groups without generating)
        assert all(m.get("rollout_inflight_min", 8) == 8 for m in metrics), (name, metrics)
        assert all(g.rewards == [float(len(s.response_ids)) for s in g.slots] for _, gs in trained for g in gs)
    # the first round waited for its scores, generating meanwhile: more tokens (the groups the
    # next rounds train), at full slots all the while
    assert results["slow"][1][0]["rollout_tokens"] > results["instant"][1][0]["rollout_tokens"]
    assert runners[0].calls >= sum(len(g.slots) for _, gs in results["slow"][2] for g in gs)   # each trained one judged


def test_each_group_is_emitted_once_and_tokens_survive_carry_over():
    """Across rounds with carry-over, every trained sample's tokens are exactly its script
    (nothing lost, duplicated or reordered), with the engine's logprobs, each token stamped
    with the version that was live when it was generated, and every group trained once."""
    ctl, trained, metrics, _ = run(drive(6, concurrency=8, target=3))
    gids = [g.gid for _, groups in trained for g in groups]
    assert len(gids) == len(set(gids)) == 18
    carried_some = sum(m["carried_samples"] for m in metrics)
    assert carried_some > 0, "the workload must exercise carry-over"
    spans_versions = 0
    for version, groups in trained:
        for g in groups:
            assert g.complete and len(g.slots) == 4
            for s in g.slots:
                L = min(length_of(g.gid, s.index), 64)   # capped by the token budget
                assert s.finish_reason == ("length" if length_of(g.gid, s.index) > 64 else "stop")
                assert s.response_ids == [TOKEN0 + p for p in range(L)]
                assert s.logprobs == [behaviour_logprob(p) for p in range(L)]
                assert len(s.versions) == L and s.versions == sorted(s.versions)
                assert max(s.versions) <= version
                spans_versions += len(set(s.versions)) > 1
            assert g.rewards == [float(len(s.response_ids)) for s in g.slots]
    assert spans_versions > 0, "some trained sample must span weight versions"


def test_an_engine_dying_mid_round_loses_no_token():
    """e1 dies in the middle of round 2 with requests in flight: they continue on e0 from the
    tokens e1 had streamed, every group is still trained once with exactly its script, and
    the failure is counted."""
    ctl, trained, metrics, clock = run(drive(5, concurrency=8, target=3, die_at=60))
    assert [f["engine"] for f in ctl.pool.failures] == ["e1"] and [e.name for e in ctl.pool.engines] == ["e0"]
    gids = [g.gid for _, groups in trained for g in groups]
    assert len(gids) == len(set(gids)) == 15
    for _version, groups in trained:
        for g in groups:
            for s in g.slots:
                L = min(length_of(g.gid, s.index), 64)
                assert s.response_ids == [TOKEN0 + p for p in range(L)]
                assert s.logprobs == [behaviour_logprob(p) for p in range(L)]
    dead = ctl.pool.retired[0]
    assert dead.served > 0 and dead.failed_with_tokens > 0, "no request died mid-stream: the failover was not exercised"


def test_frontier_first_admission_prefers_carried_then_nearly_complete_groups():
    """Carried samples (tokens already generated) are admitted before fresh ones, and among
    fresh ones the samples of the groups closest to completion go first."""
    seen = {}

    def check(ctl, version):
        seen["carried"] = {(s.gid, s.index) for g in ctl.groups.values() for s in g.slots
                           if s.response_ids and not s.done}

    async def main():
        ctl, *_ = await drive(1, concurrency=8, on_round=check)
        waiting = ctl._admission_order()   # what the next fill admits, best first
        return ctl, waiting, waiting[0]
    ctl, waiting, first = run(main())
    assert seen["carried"], "round 1 must leave carried samples"
    assert (first.gid, first.index) in seen["carried"]
    fresh = [s for s in waiting if not s.response_ids]
    if fresh:
        best = max(ctl.groups[s.gid].done_count for s in fresh)
        pick = min(fresh, key=lambda s: (-ctl.groups[s.gid].done_count, s.gid, s.index))
        assert ctl.groups[pick.gid].done_count == best


def test_stitched_old_logprobs_come_from_each_tokens_own_version():
    """A trained sample's l_old at each token is the trainer's value under the version that
    generated that token (stored prefix), and the fresh computation only for this version."""
    ctl, trained, _, _ = run(drive(6, concurrency=8))
    checked = 0
    for version, groups in trained:
        samples = [smp for g in groups for smp in ctl.samples_of(g)]
        batch = build_batch(samples, pad_id=0)
        R = batch.resp_mask.shape[1]
        computed = torch.tensor([[trainer_logprob(version, p) for p in range(R)]] * batch.size)
        stitched = stitch_old_logprobs(computed, batch)
        for i, smp in enumerate(samples):
            want = [trainer_logprob(v, p) for p, v in enumerate(smp.versions)]
            assert stitched[i, :len(want)].tolist() == pytest.approx(want, abs=1e-7)
            checked += len(set(smp.versions)) > 1
    assert checked > 0


@pytest.mark.parametrize("policy", ["finish", "restart", "drop"])
def test_staleness_bound_holds_for_everything_trained(policy):
    """With max_staleness=1, no trained token is more than 1 version older than the step
    training on it. finish (the default) discards nothing; with restart / drop samples past the
    bound are restarted (or their groups dropped) and counted, with the tokens thrown away."""
    ctl, trained, metrics, _ = run(drive(8, concurrency=6, target=2, max_staleness=1, policy=policy))
    for version, groups in trained:
        for g in groups:
            for s in g.slots:
                assert version - min(s.versions) <= 1, (version, s.versions)
    discarded = sum(m["stale_tokens_discarded"] for m in metrics)
    if policy == "finish":
        assert discarded == 0 and sum(m["restarted_samples"] + m["dropped_groups"] for m in metrics) == 0
        return
    key = "restarted_samples" if policy == "restart" else "dropped_groups"
    assert sum(m[key] for m in metrics) > 0 and discarded > 0


def test_state_saved_between_rounds_continues_identically():
    """Stop after 3 rounds, save, restore into fresh engines and controller: the next 3 rounds
    train exactly what an uninterrupted 6-round run trains (groups, tokens, versions, l_old)."""
    def summary(trained):
        return [(v, [(g.gid, [(s.response_ids, s.versions, s.old_logprobs) for s in g.slots])
                     for g in groups]) for v, groups in trained]

    _, full, _, _ = run(drive(6))
    first, part1, _, _ = run(drive(3))
    state = first.state_dict()
    import copy
    _, part2, _, _ = run(drive(3, state=copy.deepcopy(state), start_version=3))
    assert summary(part1 + part2) == summary(full)
    assert state["open"], "the saved state must hold a carry"


@pytest.mark.parametrize("update_mode", ["abort", "keep"])
def test_async_rounds_overlap_training_and_keep_the_bound(update_mode):
    """rollout.partial.async: round k+1 starts when round k ends and keeps generating while the
    'trainer' trains; the weight update holds it mid-round (abort mode: abort, load, continue;
    keep mode: pause with the requests held, load, resume them). Tokens generated during
    training carry the old version, none is lost or duplicated, at most `concurrency`
    requests run, and nothing trained at step k is more than 1 version old."""
    async def main():
        clock = Clock()
        clock.start()
        pool = EnginePool([KeyedEngine(f"e{i}", clock) for i in range(2)], 30, update_mode=update_mode)
        ctl = PartialRolloutController(
            pool, n=4, concurrency=8, max_new_tokens=64, temperature=1.0, max_staleness=1,
            stale_policy="restart", new_group=lambda: ({}, [7, 7]),
            score=lambda s: 0.0, seed=0)
        trained, overlapped = [], 0
        nxt = asyncio.ensure_future(ctl.run_round(3, 0))
        try:
            for k in range(6):
                groups = await nxt
                trained.append((k, groups))
                for slot, restarts, length, _ in ctl.pending_old_logprobs():
                    ctl.store_old_logprobs(slot, restarts, length, [trainer_logprob(k, p) for p in range(length)])
                nxt = asyncio.ensure_future(ctl.run_round(3, k + 1))
                start = clock.ticks
                while clock.ticks < start + 6:        # the trainer trains; generation goes on
                    await asyncio.sleep(0)
                overlapped += ctl.stats.tokens > 0
                await pool.reload_weights("/w", k + 1)
            nxt.cancel()
        finally:
            clock.stop()
        return trained, overlapped, clock
    trained, overlapped, clock = run(main())
    assert overlapped == 6
    if update_mode == "keep":   # requests held over the mid-round update: their tokens span versions
        assert _check_scripts(trained) > 0
    assert max(clock.running_total) <= 8
    stale_tokens = 0
    for k, groups in trained:
        for g in groups:
            for s in g.slots:
                L = min(length_of(g.gid, s.index), 64)
                assert s.response_ids == [TOKEN0 + p for p in range(L)]
                assert k - min(s.versions) <= 1, (k, s.versions)
                stale_tokens += sum(v < k for v in s.versions)
    assert stale_tokens > 0, "tokens generated during training must reach the next step"


def test_no_request_is_admitted_once_the_round_has_its_groups():
    """When the target-th group completes, admission stops at once (not when the round's
    coroutine next runs): requests finishing in the same instant must not start new ones."""
    late = []

    class Watched(PartialRolloutController):
        def _fill(self):
            before = self.stats.requests, len(self._inflight)
            super()._fill()
            if self._round_done is not None and len(self.completed) >= self._target:
                late.append(len(self._inflight) - before[1])

    async def main():
        clock = Clock()
        clock.start()
        pool = EnginePool([KeyedEngine("e0", clock)], 30)
        ctl = Watched(pool, n=1, concurrency=16, max_new_tokens=64, temperature=1.0, max_staleness=8,
                      stale_policy="restart", new_group=lambda: ({}, [7, 7]), score=lambda s: 0.0,
                      seed=0, budget_of=lambda gid, i: 2)   # all 16 finish on the same tick
        try:
            await ctl.run_round(3, 0)
        finally:
            clock.stop()
        return ctl
    ctl = run(main())
    assert sum(late) == 0, late
    assert len(ctl.completed) == 13   # the other 13 finished in the same tick: kept, not lost


# -- rollout.update_mode=keep: requests held over weight updates ----------------------------
def _check_scripts(trained) -> int:
    """Every trained sample holds exactly its script; returns how many spanned versions."""
    spanning = 0
    for version, groups in trained:
        for g in groups:
            for s in g.slots:
                L = min(length_of(g.gid, s.index), 64)
                assert s.response_ids == [TOKEN0 + p for p in range(L)], (g.gid, s.index)
                assert s.logprobs == [behaviour_logprob(p) for p in range(L)]
                assert len(s.versions) == L and s.versions == sorted(s.versions) and max(s.versions) <= version
                spanning += len(set(s.versions)) > 1
    return spanning


@pytest.mark.parametrize("keep_kv", [False, True])
def test_keep_mode_sends_each_sample_once_and_its_tokens_span_versions(keep_kv):
    """update_mode=keep: a request running at the round's end is held (engines paused), not
    aborted, lives through the weight update and finishes under the new version. Every sample
    is sent exactly once (requests per trained sample 1, nothing re-prefilled by resubmission),
    every trained token is its script with the version that produced it, and with
    keep_kv=false the update drops the held requests' KV (counted as recomputed context).
    The same workload in abort mode resubmits (the contrast the setting exists for)."""
    ctl, trained, metrics, _ = run(drive(6, concurrency=8, target=3, update_mode="keep", keep_kv=keep_kv))
    gids = [g.gid for _, groups in trained for g in groups]
    assert len(gids) == len(set(gids)) == 18
    assert _check_scripts(trained) > 0, "some trained sample must span weight versions"
    slots_started = sum(1 for g in [*ctl.groups.values(), *ctl.completed] for s in g.slots
                        if s.response_ids or (s.gid, s.index) in ctl._busy) + 18 * 4
    assert sum(e.served for e in ctl.pool.engines) == slots_started
    assert sum(m["rollout_requests_sent"] for m in metrics) == slots_started
    assert metrics[-1]["requests_per_trained_sample"] <= slots_started / (18 * 4)
    assert sum(m["requests_spanning_versions"] for m in metrics) > 0
    cleared = sum(e.kv_cleared for e in ctl.pool.engines)
    assert (cleared > 0) != keep_kv
    assert (sum(m["reprefill_tokens"] for m in metrics) > 0) != keep_kv
    _, _, abort_metrics, _ = run(drive(6, concurrency=8, target=3))
    assert abort_metrics[-1]["requests_per_trained_sample"] > metrics[-1]["requests_per_trained_sample"]
    assert sum(m["reprefill_tokens"] for m in abort_metrics) > 0


def test_keep_mode_stitches_l_old_of_held_tokens_under_their_own_version():
    """A held request's tokens generated before the update get the trainer's l_old of the
    closing version (computed from the tokens streamed so far, at the round's end), those
    after it the next version's: every trained token's stitched l_old is its own version's."""
    ctl, trained, _, _ = run(drive(6, concurrency=8, update_mode="keep"))
    checked = 0
    for version, groups in trained:
        for g in groups:
            for smp in ctl.samples_of(g):
                want = [trainer_logprob(v, p) for p, v in enumerate(smp.versions)]
                # stored prefix: every token of an older version; this version's may be missing
                assert smp.old_logprobs == pytest.approx(want[:len(smp.old_logprobs)], abs=1e-9)
                assert all(v == version for v in smp.versions[len(smp.old_logprobs):])
                checked += len(set(smp.versions)) > 1
    assert checked > 0


@pytest.mark.parametrize("policy", ["finish", "restart", "drop"])
def test_keep_mode_keeps_the_staleness_bound(policy):
    """Held requests count toward the bound like carried ones: with max_staleness=1 nothing
    trained is more than one version old; restart / drop abort a held request whose slot
    they throw away (it cannot be rewound) and still lose no token of what is trained."""
    ctl, trained, metrics, _ = run(drive(8, concurrency=6, target=2, max_staleness=1, policy=policy,
                                         update_mode="keep"))
    _check_scripts(trained)
    for version, groups in trained:
        for g in groups:
            for s in g.slots:
                assert version - min(s.versions) <= 1, (version, s.versions)


def test_keep_mode_state_saved_with_requests_in_flight_resumes_without_loss():
    """A checkpoint taken while held requests run (keep mode needs no abort for it) saves each
    one as its tokens so far; a fresh controller restored from it trains every remaining group
    once, with exactly its script (the held requests continue as continuations)."""
    saved = {}

    async def snapshot(ctl, version):
        for _ in range(3):             # the held requests run a little under the new version
            await ctl.pool.engines[0].clock.tick()
        if version == 3:
            await ctl.hold(scoring=True)
            assert ctl._inflight, "the checkpoint must be taken with requests in flight"
            import copy
            saved["state"] = copy.deepcopy(ctl.state_dict())
            saved["live"] = {(s.gid, s.index): len(s.response_ids) for s in ctl._inflight.values()}
            ctl.release()
    first, part1, _, _ = run(drive(3, update_mode="keep", between=snapshot))
    state = saved["state"]
    held = {(g["gid"], s["index"]): len(s["response_ids"]) for g in state["open"] for s in g["slots"]}
    assert all(held[k] == n and n > 0 for k, n in saved["live"].items())
    _, part2, _, _ = run(drive(3, state=state, start_version=3, update_mode="keep"))
    gids = [g.gid for _, groups in part1 + part2 for g in groups]
    assert len(gids) == len(set(gids)) == 18
    _check_scripts(part2)


def test_keep_mode_state_saved_while_a_group_is_being_scored_scores_it_again():
    """Keep mode: held requests keep running while a checkpoint is taken, so a group may
    complete and be scoring (off the loop) at that moment. The snapshot still succeeds and
    saves that group open and unscored: the restored controller scores it again and trains
    it, with its tokens intact (before, such a group was saved scored without rewards)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    gate = threading.Event()

    async def main():
        clock = Clock()
        clock.start()
        pool = EnginePool([KeyedEngine("e0", clock)], 30, update_mode="keep")

        def score(sample):
            gate.wait(10)               # scoring in progress until the test lets it go
            return 1.0
        ctl = PartialRolloutController(
            pool, n=1, concurrency=4, max_new_tokens=64, temperature=1.0, max_staleness=8,
            stale_policy="restart", new_group=lambda: ({}, [7, 7]), score=score, seed=0,
            scorer=ThreadPoolExecutor(max_workers=1))
        try:
            task = asyncio.ensure_future(ctl.run_round(1, 0))
            while not ctl._scoring:     # a group completed and its scoring blocks
                await asyncio.sleep(0)
            state = ctl.state_dict()
            gate.set()
            await task
        finally:
            gate.set()
            clock.stop()
        return state
    state = run(main())
    scoring = [g for g in state["open"] if all(s["finish_reason"] for s in g["slots"])]
    assert scoring and all(not g["reward_done"] and g["rewards"] == [] for g in scoring)
