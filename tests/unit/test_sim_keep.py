"""The simulator's keep-mode weight updates (rollout.update_mode=keep, rollout.keep_kv) and the
trainer's intra-step overlap (rollout.overlap), pinned by hand-computable virtual-time runs."""
import asyncio

import pytest
from test_simulator import Linear, _fixed

from megarl.rollout.engines.engine import EngineError, GenRequest
from megarl.sim import clock as vclock
from megarl.sim.costs import H100, MeasuredTrainer, RooflineTrainer, published_models
from megarl.sim.engine import SimEngine
from megarl.sim.run import SimSettings, _overlap, simulate
from megarl.sim.workload import Workload, parse_dist


def _on_engine(costs, body):
    """Run `body(engine, loop)` on a started SimEngine on the virtual clock; returns its result."""
    async def main():
        e = SimEngine("e", costs)
        await e.start()
        try:
            return await body(e, asyncio.get_running_loop())
        finally:
            await e.close()
    return vclock.run(main())


# -- the engine ---------------------------------------------------------------------------------
def test_a_held_request_spans_the_versions_it_was_held_over():
    """1 s per step, loads of 2 s. Paused at 3.5 s the engine finishes the step in flight (4
    tokens at 4 s, nothing more while paused), loads version 1 with the request held, runs 2
    steps, is held over version 2, and ends: 4 tokens of v0, 2 of v1, 4 of v2, at 4+2+2+2+4 s."""
    async def body(e, loop):
        task = asyncio.ensure_future(e.generate(GenRequest("x", [1], 10)))
        await asyncio.sleep(3.5)
        await e.pause()
        paused_at, held = loop.time(), e.partial("x")
        await e.reload_weights("w", 1)
        assert e.partial("x").versions == [0] * 4          # a load produces no token
        await e.resume()
        await asyncio.sleep(2.0)
        await e.pause()
        await e.reload_weights("w", 2)
        await e.resume()
        return paused_at, held, await task, loop.time(), e.log
    paused_at, held, res, end, log = _on_engine(Linear(a=1.0, load_weights_s=2.0), body)
    assert paused_at == pytest.approx(4.0) and held.versions == [0] * 4 and held.finish_reason == "abort"
    assert res.finish_reason == "length" and res.versions == [0] * 4 + [1] * 2 + [2] * 4
    assert res.token_ids[:4] == held.token_ids and len(res.logprobs) == 10
    assert end == pytest.approx(4 + 2 + 2 + 2 + 4)
    assert (log.multi_version_requests, log.multi_version_tokens, log.requests) == (1, 10, 1)


def test_two_updates_without_a_token_between_leave_only_the_newest_version():
    async def body(e, loop):
        task = asyncio.ensure_future(e.generate(GenRequest("x", [1], 5)))
        await asyncio.sleep(1.5)
        await e.pause()
        await e.reload_weights("w", 1)
        await e.reload_weights("w", 2)
        await e.resume()
        return await task
    res = _on_engine(Linear(a=1.0), body)
    assert res.versions == [0, 0, 2, 2, 2]


def test_clear_kv_reprefills_exactly_the_held_context():
    """Step = 1 s + 1 s per prefilled token, prompt 4: the first step takes 5 s; paused at
    6.5 s the request holds 3 tokens (at 7 s). With clear_kv its next step prefills prompt +
    3 tokens = 7 (8 s) and it ends at 7 + 8 + 6; keeping the KV it ends at 7 + 7. A request
    waiting to join is not re-prefilled (it prefills its prompt when it joins anyway)."""
    def run(clear: bool):
        async def body(e, loop):
            task = asyncio.ensure_future(e.generate(GenRequest("x", [1] * 4, 10)))
            await asyncio.sleep(6.5)
            await e.pause()
            waiting = asyncio.ensure_future(e.generate(GenRequest("w", [1] * 2, 1)))
            await asyncio.sleep(0)
            await e.reload_weights("w", 1)
            if clear:
                await e.clear_kv()
                await e.clear_kv()       # twice: still one recompute
            await e.resume()
            res = await task
            await waiting
            return res, loop.time(), e.log
        return _on_engine(Linear(a=1.0, p=1.0), body)
    (res, end, log), (kept, end_kept, log_kept) = run(True), run(False)
    assert res.versions == kept.versions == [0] * 3 + [1] * 7
    assert log.reprefill_tokens == 7 and log.prefill_tokens == 4 + 2 + 7
    assert log_kept.reprefill_tokens == 0 and log_kept.prefill_tokens == 4 + 2
    assert end_kept == pytest.approx(7 + 7 + 2) and end == pytest.approx(7 + 8 + 6 + 2)


def test_a_held_request_aborted_after_clear_kv_is_not_reprefilled():
    async def body(e, loop):
        task = asyncio.ensure_future(e.generate(GenRequest("x", [1] * 4, 10)))
        await asyncio.sleep(2.5)
        await e.pause()
        await e.reload_weights("w", 1)
        await e.clear_kv()
        await e.abort(["x"])
        await e.resume()
        return await task, e.log
    res, log = _on_engine(Linear(a=1.0), body)
    assert res.finish_reason == "abort" and len(res.token_ids) == 3 and log.reprefill_tokens == 0


def test_pause_weights_and_kv_rules():
    """Weights and clear_kv need a paused engine; pause with nothing running returns at once
    (abort mode's update: the step in flight serves nobody); partial of an unknown key is None
    and a partial is a copy."""
    async def body(e, loop):
        with pytest.raises(EngineError, match="paused"):
            await e.reload_weights("w", 1)
        with pytest.raises(EngineError, match="paused"):
            await e.clear_kv()
        task = asyncio.ensure_future(e.generate(GenRequest("x", [1], 10)))
        await asyncio.sleep(2.5)
        snap = e.partial("x")
        snap.token_ids.append(99)
        assert len(e.partial("x").token_ids) == 2 and e.partial("nobody") is None
        await e.abort()
        t = loop.time()
        await e.pause()
        assert loop.time() == t
        await e.resume()
        return await task
    assert len(_on_engine(Linear(a=1.0), body).token_ids) == 2


# -- keep mode in the training loop (the pool's update_mode / keep_kv) ----------------------------
def _carrying_workload():
    return Workload(parse_dist("pareto:alpha=1.1,xmin=4"), n=4, max_len=200, seed=3)


def _run(mode="partial", steps=8, trainer=None, costs=None, **over):
    s = SimSettings(mode=mode, steps=steps, groups_per_step=4, concurrency=16, **over)
    return simulate(s, _carrying_workload(), costs or Linear(a=0.01), trainer or MeasuredTrainer(0.1, 0.0))


def test_keep_round_at_concurrency_two_by_hand():
    """test_simulator's abort-mode run in keep mode: round 0 is group 0's two samples, then
    group 1's (20 steps); a sample of group 2 admitted after group 1's first result is held at
    the round's end, once the step in flight ended (21 steps: its token is kept, version 0),
    and goes on under version 1: no request is sent for it again (9 requests, abort mode 10)."""
    out = simulate(SimSettings(mode="partial", steps=2, groups_per_step=2, concurrency=2, update_mode="keep"),
                   _fixed(), Linear(a=0.01), MeasuredTrainer(0.0, 0.0))
    assert out["per_step"][0]["rollout_s"] == pytest.approx(0.21)
    assert out["trained_tokens"] == 80 and out["requests"] == 9 and out["requests_per_trained_sample"] == 1.0
    assert out["multi_version_requests"] >= 1 and out["per_step"][1]["multi_version_sample_tokens"] == 10


def test_keep_mode_sends_one_request_per_sample_abort_mode_resubmits():
    """Long samples are carried over rounds. keep: nothing is resubmitted (every prefilled
    token beyond a sample's first prompt is KV recomputed after an update), each carried
    request's own tokens span versions, and every sample sent gets exactly one request.
    abort: every carried sample is sent again, its prompt and tokens so far prefilled again,
    and no request spans versions."""
    keep, abort = _run(update_mode="keep"), _run(update_mode="abort")
    assert keep["trained_samples"] == abort["trained_samples"] == 8 * 4 * 4
    assert keep["requests"] == keep["samples_started"]
    assert abort["requests"] > abort["samples_started"]
    assert keep["requests_per_trained_sample"] == 1.0 < abort["requests_per_trained_sample"]
    assert abort["trained_sample_requests"] <= abort["requests"]
    assert keep["reprefill_tokens"] == keep["kv_recomputed_tokens"] > 0
    assert abort["kv_recomputed_tokens"] == 0 and abort["reprefill_tokens"] > 0
    # abort: a continuation prefills its prompt (16 tokens here) and its tokens so far again
    resent = abort["requests"] - abort["samples_started"]
    assert abort["reprefill_tokens"] == abort["resent_tokens"] + 16 * resent and abort["resent_tokens"] > 0
    assert keep["resent_tokens"] == 0
    assert keep["multi_version_requests"] > 0 and keep["multi_version_tokens"] > 0
    assert abort["multi_version_requests"] == abort["multi_version_tokens"] == 0
    # either way a carried sample's tokens keep the versions that produced them
    assert keep["multi_version_sample_tokens"] > 0 and abort["multi_version_sample_tokens"] > 0


def test_keep_kv_false_recomputes_the_held_context_at_every_update(monkeypatch):
    """What the engines re-prefill is, summed over the updates, prompt + tokens so far of each
    request held over it (the run's last update excepted: its recompute comes after the run);
    keep_kv=true recomputes nothing. With a free prefill both runs take the same path, so
    their prefills differ by exactly that."""
    held = []
    orig = SimEngine.clear_kv

    async def spy(self):
        held.append(sum(r.prompt + len(self.partial(k).token_ids) for k, r in self._running.items()
                        if r.joined >= 0))
        await orig(self)
    monkeypatch.setattr(SimEngine, "clear_kv", spy)
    dropped = _run(update_mode="keep", keep_kv=False)
    monkeypatch.setattr(SimEngine, "clear_kv", orig)
    kept = _run(update_mode="keep", keep_kv=True)
    assert len(held) == 8 and held[-1] > 0          # one engine, one update per step
    assert dropped["kv_recomputed_tokens"] == sum(held[:-1]) > 0
    assert kept["kv_recomputed_tokens"] == kept["reprefill_tokens"] == 0
    assert dropped["prefill_tokens"] - kept["prefill_tokens"] == sum(held[:-1])
    assert dropped["wall_s"] == pytest.approx(kept["wall_s"])


def test_keep_kv_costs_the_prefill_time():
    """With a prefill price, dropping the KV makes the same steps slower than keeping it."""
    costs = Linear(a=0.01, p=0.001)
    dropped = _run(update_mode="keep", keep_kv=False, costs=costs)
    kept = _run(update_mode="keep", keep_kv=True, costs=costs)
    assert dropped["rollout_s"] > kept["rollout_s"]


# -- overlap --------------------------------------------------------------------------------------
def test_overlap_schedule_by_hand():
    """Group a (1.5 s of trained models' passes + 0.5 s frozen) ready at 1 s, b (1 s) at
    1.5 s, one after another: 1-3 s, 3-4 s; the round ends at 3.5 s: 2.5 s during it, b
    finished after it (0.5 s). At the next version only a's trained models' passes run again
    (its frozen one is kept); at the same version nothing. A trainer busy until the round
    ends, or a group ready after it, runs nothing."""
    cost = {"a": (1.5, 0.5), "b": (1.0, 0.0)}.get
    cache = {}
    assert _overlap([(1.5, "b"), (1.0, "a")], 0.0, 3.5, 0, cache, cost) == pytest.approx((2.5, 0.5))
    assert cache["a"].version == 0 and cache["a"].frozen
    assert _overlap([(1.0, "a")], 0.0, 9.0, 1, cache, cost) == pytest.approx((1.5, 0.0))
    assert _overlap([(1.0, "a"), (1.5, "b")], 0.0, 9.0, 1, cache, cost) == pytest.approx((1.0, 0.0))
    assert _overlap([(1.0, "c")], 5.0, 4.0, 0, {}, lambda g: (2.0, 0.0)) == (0.0, 0.0)
    assert _overlap([(6.0, "c")], 0.0, 4.0, 0, {}, lambda g: (2.0, 0.0)) == (0.0, 0.0)


def test_overlap_hides_forward_passes_behind_the_round():
    """Forward passes 90% of a costly train time: with overlap the rounds are the same (the
    trainer does not slow the engines), each step's train time after its round is shorter by
    the trained groups' passes done during it (plus a pass finished after the round), the run
    is that much faster, and the trainer's idle share counts the seconds during the round as
    work. Without forward passes to run, nothing overlaps."""
    trainer = MeasuredTrainer(0.05, 2e-3, forward_frac=0.9)
    base = _run(trainer=trainer)
    over = _run(trainer=trainer, overlap=True)
    for b, o in zip(base["per_step"], over["per_step"]):
        assert o["rollout_s"] == pytest.approx(b["rollout_s"])
        assert o["train_s"] == pytest.approx(b["train_s"] - o["overlap_hidden_s"] + o["overlap_after_s"])
        assert o["overlap_hidden_s"] <= 0.9 * 2e-3 * o["trained_tokens"] + 1e-9
    after = sum(x["overlap_after_s"] for x in over["per_step"])
    assert 0.0 < over["overlap_hidden_s"] <= over["overlap_s"] + after + 1e-9   # spared only what it ran
    assert over["wall_s"] == pytest.approx(base["wall_s"] - over["overlap_hidden_s"] + after)
    assert over["wall_s"] < base["wall_s"]
    assert over["trainer_idle_frac"] == pytest.approx(1 - (over["train_s"] + over["overlap_s"]) / over["wall_s"])
    assert over["trainer_idle_frac"] < base["trainer_idle_frac"]
    none = _run(trainer=MeasuredTrainer(0.05, 2e-3), overlap=True)
    assert none["overlap_s"] == 0.0 and none["wall_s"] == pytest.approx(base["wall_s"])


def test_overlap_runs_groups_left_for_later_steps_and_keeps_their_frozen_passes():
    """Rounds that complete groups for later steps (staleness bound 2 with fixed steps: round 0
    completes the next steps' groups too): the trainer also spends round time on those, and a later step
    runs again their trained models' passes (only the frozen share is kept over the update),
    so the run's pass work during and right after rounds exceeds what it spared the steps;
    it can never spare more than it did."""
    trainer = MeasuredTrainer(0.0, 2e-3, forward_frac=0.9, frozen_frac=0.5)
    w = Workload(parse_dist("lognormal:mu=3,sigma=1.2"), n=4, max_len=200, seed=1)
    out = simulate(SimSettings(mode="partial", steps=6, groups_per_step=2, concurrency=16, overlap=True,
                               max_staleness=2, max_step_multiple=1), w, Linear(a=0.01), trainer)
    assert sum(x["rollout_s"] == 0.0 for x in out["per_step"]) >= 1   # a step whose groups were ready
    worked = out["overlap_s"] + sum(x["overlap_after_s"] for x in out["per_step"])
    assert worked > out["overlap_hidden_s"] > 0.0


def test_async_rounds_ready_before_the_trainer_leave_nothing_to_overlap():
    """Async with training far longer than a round: from step 1 on, each round ended while the
    trainer still trained the step before (one resource), so only step 0 overlaps."""
    trainer = MeasuredTrainer(2.0, 1e-3, forward_frac=0.5)
    out = simulate(SimSettings(mode="async", steps=4, groups_per_step=2, concurrency=4, overlap=True,
                               max_step_multiple=1),   # fixed steps: a round ends once it has its groups
                   _fixed(), Linear(a=0.01), trainer)
    assert out["per_step"][0]["overlap_s"] > 0.0
    assert all(s["overlap_s"] == 0.0 for s in out["per_step"][1:])


def test_roofline_forward_share_is_the_forward_only_passes():
    """PPO: actor + critic trained (6 + 6), old, reference and values forward (2 + 2 + 2):
    1/3 of the FLOPs; GRPO: actor (6), old and reference (2 + 2): 0.4. The frozen one (the
    reference) is a third of PPO's passes, half of GRPO's."""
    m = published_models()["qwen2.5-7b"]
    ppo, grpo = RooflineTrainer(m, H100, 8), RooflineTrainer(m, H100, 8, critic=False)
    assert ppo.forward_frac == pytest.approx(1 / 3) and grpo.forward_frac == pytest.approx(0.4)
    assert ppo.frozen_frac == pytest.approx(1 / 3) and grpo.frozen_frac == pytest.approx(1 / 2)   # the reference
    for t in (ppo, grpo):
        assert t.forward_s(1000, 4) == pytest.approx(t.forward_frac * t.train_s(1000, 0, 4))
        assert t.forward_s(1000, 4) < t.train_s(1000, 500, 4)


def test_bad_keep_and_overlap_settings_are_named():
    with pytest.raises(ValueError, match="update_mode='hold'"):
        SimSettings(update_mode="hold")
    with pytest.raises(ValueError, match="keep_kv=True"):
        SimSettings(update_mode="abort", keep_kv=True)
    with pytest.raises(ValueError, match="overlap=True"):
        SimSettings(mode="sync", overlap=True)
    with pytest.raises(ValueError, match="forward_frac=1.5"):
        MeasuredTrainer(0.0, 1.0, forward_frac=1.5)

    class NoForward:
        push_s = 0.0

        def train_s(self, *a, **k):
            return 0.0
    with pytest.raises(ValueError, match="forward_s"):
        simulate(SimSettings(overlap=True, steps=1), _fixed(), Linear(a=0.01), NoForward())
