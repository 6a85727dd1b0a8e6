"""The simulator's virtual clock and engine, pinned by hand-computable runs."""
import asyncio
import json
from dataclasses import dataclass

import pytest

from megarl.rollout.engines.engine import GenRequest
from megarl.sim import clock as vclock
from megarl.sim.costs import MeasuredEngine, MeasuredTrainer, interp
from megarl.sim.engine import SimEngine
from megarl.sim.run import SimSettings, simulate
from megarl.sim.workload import Workload, parse_dist


@dataclass
class Linear:
    """step = a + c * batch (+ p per prefill token, r per new request)."""
    a: float
    c: float = 0.0
    p: float = 0.0
    r: float = 0.0
    load_weights_s: float = 0.0

    def step_s(self, batch, context_tokens, prefill_tokens, new_requests):
        return self.a + self.c * batch + self.p * prefill_tokens + self.r * new_requests


def test_virtual_clock_adds_sleeps_without_waiting():
    async def main():
        loop = asyncio.get_running_loop()
        await asyncio.gather(asyncio.sleep(5.0), asyncio.sleep(3.0))
        await asyncio.sleep(1.5)
        return loop.time()
    assert vclock.run(main()) == pytest.approx(6.5)


def test_virtual_clock_reports_a_deadlock():
    async def main():
        await asyncio.Event().wait()
    with pytest.raises(vclock.SimulationDeadlock):
        vclock.run(main())


def test_engine_batches_continuously():
    """Requests of 3 and 5 tokens together: 3 steps at batch 2, then 2 at batch 1; prefill of
    both prompts (4 tokens each) and 2 request costs in the first step."""
    async def main():
        e = SimEngine("e", Linear(a=0.010, c=0.002, p=0.001, r=0.005))
        await e.start()
        loop = asyncio.get_running_loop()
        ends = {}

        async def one(key, n):
            res = await e.generate(GenRequest(key, [1, 2, 3, 4], n))
            ends[key] = loop.time()
            return res
        res = await asyncio.gather(one("a", 3), one("b", 5))
        await e.close()
        return ends, res, e.log
    ends, res, log = vclock.run(main())
    first = 0.010 + 2 * 0.002 + 8 * 0.001 + 2 * 0.005
    batch2 = 0.010 + 2 * 0.002
    batch1 = 0.010 + 0.002
    assert ends["a"] == pytest.approx(first + 2 * batch2)
    assert ends["b"] == pytest.approx(first + 2 * batch2 + 2 * batch1)
    assert [len(r.token_ids) for r in res] == [3, 5] and res[0].finish_reason == "length"
    assert log.tokens == 8 and log.prefill_tokens == 8 and log.steps == 5


def test_abort_keeps_partial_tokens_and_update_needs_pause():
    async def main():
        e = SimEngine("e", Linear(a=1.0, load_weights_s=2.0))
        await e.start()
        task = asyncio.ensure_future(e.generate(GenRequest("x", [1], 10)))
        await asyncio.sleep(3.5)            # 3 steps done
        with pytest.raises(RuntimeError, match="paused"):
            await e.reload_weights("w", 1)
        await e.abort()
        res = await task
        await e.pause()
        t = asyncio.get_running_loop().time()
        await e.reload_weights("w", 1)
        took = asyncio.get_running_loop().time() - t
        await e.close()
        return res, took, e.version
    res, took, version = vclock.run(main())
    assert res.finish_reason == "abort" and len(res.token_ids) == 3 and res.versions == [0, 0, 0]
    assert took == pytest.approx(2.0) and version == 1


def test_a_key_resubmitted_after_an_abort_runs_its_full_length():
    """The pool re-sends a failed request under the same key: the aborted run's end must not
    end the new one early."""
    async def main():
        e = SimEngine("e", Linear(a=1.0))
        await e.start()
        first = asyncio.ensure_future(e.generate(GenRequest("k", [1], 5)))
        await asyncio.sleep(2.5)            # 2 steps done; the first run would end after step 5
        await e.abort(["k"])
        await first
        res = await e.generate(GenRequest("k", [1], 5))
        await e.close()
        return res
    res = vclock.run(main())
    assert len(res.token_ids) == 5 and res.finish_reason == "length"


def _fixed(n=2, length=10):
    return Workload(parse_dist(f"fixed:len={length}"), n=n, max_len=64, prompt_len=lambda g: 4)


def test_sync_step_time_by_hand():
    """2 groups x 2 samples of 10 tokens at a constant 0.01 s/step: rollout 0.1 s; then train
    1.0 s, push 0.5 s on the trainer and a 0.25 s load on the engine."""
    out = simulate(SimSettings(mode="sync", steps=3, groups_per_step=2), _fixed(),
                   Linear(a=0.01, load_weights_s=0.25), MeasuredTrainer(1.0, 0.0, push_s=0.5))
    assert out["wall_s"] == pytest.approx(3 * (0.1 + 1.0 + 0.5 + 0.25))
    assert out["trained_tokens"] == 3 * 40 and out["requests"] == 12
    assert out["per_step"][0]["rollout_s"] == pytest.approx(0.1)


def test_partial_round_at_concurrency_two_by_hand():
    """Concurrency 2, groups of 2 x 10 tokens: frontier-first runs group 0's two samples
    together, then group 1's: round 0 takes 20 steps. Both of group 1's samples finish in the
    same engine step, but the controller learns of them one at a time: after the first it
    admits a sample of group 2 (the round's target is not reached yet), which starts an engine
    step that is still running when the round's abort and the weight update come: round 1
    waits for that step (21 steps). No token of it is kept (abort before the step ended).
    update_mode=abort: tests/unit/test_sim_keep.py has the same run in keep mode."""
    out = simulate(SimSettings(mode="partial", steps=2, groups_per_step=2, concurrency=2, update_mode="abort"),
                   _fixed(), Linear(a=0.01), MeasuredTrainer(0.0, 0.0))
    assert [s["rollout_s"] for s in out["per_step"]] == pytest.approx([0.20, 0.21])
    assert out["generated_tokens"] == out["trained_tokens"] == 80
    assert out["per_step"][0]["rollout_requests"] == 5


def test_partial_carries_long_samples_and_counts_their_staleness():
    """One long sample per group: rounds end before it finishes, it is carried and trained
    later with tokens of older versions."""
    w = Workload(parse_dist("pareto:alpha=1.1,xmin=4"), n=4, max_len=200, seed=3)
    out = simulate(SimSettings(mode="partial", steps=8, groups_per_step=4, concurrency=16), w,
                   Linear(a=0.01), MeasuredTrainer(0.1, 0.0))
    assert out["staleness_max"] >= 1
    assert out["generated_tokens"] > out["trained_tokens"]


def test_async_hides_rollout_behind_training():
    """Training (2 s) is far longer than a round (0.1 s): from step 1 on, the next round is
    ready when the trainer asks (only the in-round weight update waits), tokens are 1 version
    old, and the trainer is idle only during the first rollout and the pushes. (abort mode: in
    keep mode the first round also waits for the engine step in flight at its end.)"""
    # fixed steps: the round ends once it has its groups (elastic ones generate until the step asks)
    out = simulate(SimSettings(mode="async", steps=5, groups_per_step=2, concurrency=4, update_mode="abort",
                               max_step_multiple=1),
                   _fixed(),
                   Linear(a=0.01), MeasuredTrainer(2.0, 0.0))
    assert out["per_step"][0]["rollout_s"] == pytest.approx(0.1)
    assert all(s["rollout_s"] == pytest.approx(0.0) for s in out["per_step"][1:])
    assert out["staleness_max"] == 1
    assert out["wall_s"] == pytest.approx(0.1 + 5 * 2.0)


@pytest.mark.parametrize("mode", ["sync", "partial", "async"])
def test_the_simulator_steps_through_the_drivers_round_stepper(mode, monkeypatch):
    """sim/run.py runs the driver's stepping (rollout/rounds.RoundStepper), in train.py's order:
    round, pending, prefetch of the next round, store; only async mode's prefetch starts a
    round. Its trainer_idle_frac is the trainer's definition (metrics/step.py) over the sums."""
    from megarl.metrics.step import trainer_idle_frac
    from megarl.rollout.controller.rounds import RoundStepper
    calls, started = [], []

    def spy(name):
        orig = getattr(RoundStepper, name)
        if asyncio.iscoroutinefunction(orig):
            async def wrapped(self, *args):
                calls.append(name)
                return await orig(self, *args)
        else:
            def wrapped(self, *args):
                calls.append(name)
                out = orig(self, *args)
                if name == "prefetch":
                    started.append(self._next is not None)
                return out
        monkeypatch.setattr(RoundStepper, name, wrapped)
    for name in ("round", "pending", "prefetch", "store"):
        spy(name)
    out = simulate(SimSettings(mode=mode, steps=3, groups_per_step=2, concurrency=4), _fixed(),
                   Linear(a=0.01), MeasuredTrainer(0.5, 0.0, push_s=0.1))
    assert calls == ["round", "pending", "prefetch", "store"] * 2 + ["round", "pending", "store"]
    assert started == [mode == "async"] * 2
    assert out["trainer_idle_frac"] == trainer_idle_frac(out["train_s"], out["wall_s"])
    assert out["trainer_idle_frac"] == pytest.approx(1 - 3 * 0.5 / out["wall_s"])


@pytest.mark.parametrize("policy", ["finish", "restart"])
def test_staleness_bound_holds_in_the_simulator(policy):
    """Partial with max_staleness=0: everything trained is on-policy, under the default policy
    (finish: nothing thrown away) and under restart (a carried sample's old tokens are thrown
    away each round); unbounded, the same run trains stale tokens."""
    w = Workload(parse_dist("pareto:alpha=1.1,xmin=4"), n=4, max_len=200, seed=3)
    run = lambda bound: simulate(SimSettings(mode="partial", steps=8, groups_per_step=4, concurrency=16,
                                             max_staleness=bound, stale_policy=policy), w, Linear(a=0.01),
                                 MeasuredTrainer(0.1, 0.0))
    bounded, free = run(0), run(10**9)
    assert bounded["staleness_max"] == 0 and free["staleness_max"] >= 1
    restarted = sum(s.get("restarted_samples", 0) for s in bounded["per_step"])
    assert (restarted > 0) if policy == "restart" else (restarted == 0)
    with pytest.raises(ValueError, match="max_staleness=0"):
        SimSettings(mode="async", max_staleness=0)


def test_interp_is_piecewise_linear():
    curve = {1: 1.0, 4: 4.0, 8: 6.0}
    assert interp(curve, 2) == pytest.approx(2.0)
    assert interp(curve, 6) == pytest.approx(5.0)
    assert interp(curve, 16) == pytest.approx(10.0)     # extrapolated
    e = MeasuredEngine(curve, prefill_s_per_token=0.5, request_s=0.25, load_weights_s=0.0)
    assert e.step_s(4, 0, 2, 1) == pytest.approx(4.0 + 1.0 + 0.25)


@pytest.mark.parametrize("bad", ["lognormal:mu=3", "weibull:k=1", "pareto:alpha=0,xmin=1", "fixed:len=0"])
def test_bad_length_distribution_is_named(bad):
    with pytest.raises(ValueError, match="length distribution"):
        parse_dist(bad)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="mode"):
        SimSettings(mode="overlap")
    with pytest.raises(ValueError, match="concurrency=0"):
        SimSettings(concurrency=0)


def _bench_json(tmp_path):
    result = {"decode_step_s": {"1": 0.01, "64": 0.02, "128": 0.035}, "concurrency": 64, "engines": 1,
              "overheads": {"request_s": 0.0015, "prefill_s_per_token": 4e-5},
              "per_step": {"sync": [{"push_s": 1.0, "train_s": 2.0, "tokens": 2000}],
                           "partial": [{"push_s": 1.2, "train_s": 2.0, "tokens": 2000}]}}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(result))
    return path


def test_megarl_simulate_a_recipe(tmp_path, capsys):
    from megarl.cli import main
    rc = main(["simulate", "recipes/tiny_cpu.yaml", "--calibration", str(_bench_json(tmp_path)), "--steps", "3",
               "--json", "rollout.sampling.max_new_tokens=128"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["modes"]) == {"sync", "partial", "async"} and out["recipe_mode"] == "partial"
    assert out["modes"]["async"]["trainer_idle_frac"] < out["modes"]["sync"]["trainer_idle_frac"]


@pytest.mark.parametrize("args,named", [(["--gpu", "a100"], "--gpu"), (["--model", "gpt5"], "--model"),
                                        (["--lengths", "zipf:s=1"], "--lengths"),
                                        (["--calibration", "missing.json"], "--calibration")])
def test_megarl_simulate_bad_input(args, named, capsys):
    from megarl.cli import main
    assert main(["simulate", "recipes/tiny_cpu.yaml", *args]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


# -- the weight sync by route (megarl/sim/costs.py WeightSyncCosts) ---------------------------
def _model_70b():
    from megarl.sim.costs import published_models
    return published_models()["llama3.1-70b"]


def test_collective_push_is_one_broadcast_whatever_the_engine_count():
    """The bytes leave the trainer once: more engines add only the per-engine term. By hand:
    141 GB over a 40 GB/s link, the engine's copy of its quarter at half of 3.35 TB/s, 0.1 s."""
    from megarl.sim.costs import H100, WeightSyncCosts, weight_push_s
    m, sync = _model_70b(), WeightSyncCosts()
    trainer, engine = weight_push_s(m, H100, 1, 4, "collective")
    assert trainer == 0.0
    assert engine == pytest.approx(m.weight_bytes / 40e9 + 0.05 + m.weight_bytes / 4 / (3.35e12 * 0.5) + 0.1)
    for engines in (2, 8, 64):
        more = sum(weight_push_s(m, H100, engines, 4, "collective"))
        assert more == pytest.approx(trainer + engine + (engines - 1) * sync.per_engine_s)


def test_files_push_grows_linearly_with_the_engines():
    """Written once (trainer side), read whole by every engine from the shared file system."""
    from megarl.sim.costs import H100, WeightSyncCosts, weight_push_s
    m, sync = _model_70b(), WeightSyncCosts()
    pushes = [weight_push_s(m, H100, engines, 4, "files") for engines in (1, 2, 3, 8)]
    assert [p[0] for p in pushes] == pytest.approx([m.weight_bytes / sync.write_bytes_per_s] * 4)
    step = m.weight_bytes / sync.read_bytes_per_s
    assert [p[1] - pushes[0][1] for p in pushes] == pytest.approx([0, step, 2 * step, 7 * step])
    assert sum(pushes[0]) > sum(weight_push_s(m, H100, 1, 4, "collective"))
    with pytest.raises(ValueError, match="weight_sync.transport='nfs'"):
        weight_push_s(m, H100, 1, 4, "nfs")


def test_the_simulated_step_pays_the_push_once_however_many_engines():
    """In the loop the engines load in parallel (the pool's update), so a step's push is the
    trainer side + ONE engine side: with collective costs, 1 and 4 engines differ by 3 x the
    per-engine term only."""
    from megarl.sim.costs import H100, WeightSyncCosts, weight_push_s
    m = _model_70b()

    def push_of_step(engines):
        send, load = weight_push_s(m, H100, engines, 4, "collective")
        out = simulate(SimSettings(mode="sync", steps=2, groups_per_step=2, engines=engines), _fixed(),
                       Linear(a=0.01, load_weights_s=load), MeasuredTrainer(1.0, 0.0, push_s=send))
        return out["per_step"][1]["push_s"]
    assert push_of_step(4) - push_of_step(1) == pytest.approx(3 * WeightSyncCosts().per_engine_s)


@pytest.mark.parametrize("route", ["collective", "files"])
def test_the_recipe_picks_the_route(route, tmp_path):
    """`megarl simulate`: the roofline push follows weight_sync.transport and rollout.engines.count;
    a measured push (bench/rollout_speedup.py, 1 engine, files) scales with the engines only
    on the files route."""
    from megarl.config import load_config
    from megarl.sim.costs import H100, weight_push_s
    from megarl.sim.recipe import measured_costs, roofline_costs
    for engines in (1, 4):
        cfg = load_config("recipes/tiny_cpu.yaml",
                          [f"rollout.engines.count={engines}", f"weight_sync.transport={route}"])
        engine, trainer = roofline_costs(cfg, "h100", "llama3.1-70b", 4, 32)
        ws = cfg.weight_sync   # staged / sharded: the recipe's (tiny_cpu's trainer: one shard owner)
        assert (trainer.push_s, engine.load_weights_s) == weight_push_s(_model_70b(), H100, engines, 4, route,
                                                                        staged=ws.staged, sharded=ws.sharded)
        assert trainer.route == route
        measured, _ = measured_costs(str(_bench_json(tmp_path)), cfg)
        assert measured.load_weights_s == pytest.approx(1.1 * (engines if route == "files" else 1))
