"""`simulate`: megarl's training loop on the virtual clock, with simulated engines and trainer.

What runs is megarl's own code: `EnginePool` (least-loaded placement, versioned updates that
hold the controller, abort, pause, load, resume), `PartialRolloutController` (fixed
concurrency, frontier-first admission, group emission, carry, staleness) and the driver's
stepping `RoundStepper` (megarl/rollout/rounds.py: which round runs when, prefetch, stitching),
unmodified. Only the engines (`SimEngine`) and the trainer (a sleep of its modelled time) are
simulated. A step follows `megarl/train.py`:
- sync: all groups_per_step x n samples of fresh prompts at once; wait for the longest.
- partial: `controller.run_round(groups_per_step, k)`; the rest is carried.
- async: partial, and the round of step k+1 starts as soon as round k ended (the driver's
  `prefetch`), so it generates while the trainer trains; the weight update in between holds
  it, aborts what runs (kept as partials) and releases it under the new version.
then: stitched l_old of the carried tokens (partial/async), train, push weights (trainer side,
then `pool.update_weights` on every engine).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from megarl.metrics.step import trainer_idle_frac
from megarl.rollout.controller import PartialRolloutController
from megarl.rollout.engine import GenRequest
from megarl.rollout.pool import EnginePool
from megarl.rollout.rounds import RoundStepper
from megarl.sim import clock as vclock
from megarl.sim.engine import SimEngine
from megarl.sim.workload import Workload

MODES = ("sync", "partial", "async")


@dataclass
class SimSettings:
    mode: str = "partial"
    steps: int = 10
    groups_per_step: int = 16
    concurrency: int = 64
    engines: int = 1
    max_staleness: int = 10**9
    stale_policy: str = "finish"               # as rollout.partial.stale_policy (the schema's default)
    seed: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"simulation mode {self.mode!r}: choose one of {MODES}")
        for name in ("steps", "groups_per_step", "concurrency", "engines"):
            if getattr(self, name) < 1:
                raise ValueError(f"simulation {name}={getattr(self, name)}: must be >= 1")
        if self.mode == "async" and self.max_staleness < 1:   # the rule of rollout.partial.async in the schema
            raise ValueError(f"simulation max_staleness={self.max_staleness}: async mode trains tokens one "
                             f"version old; set it >= 1")


def simulate(settings: SimSettings, workload: Workload, engine_costs, trainer,
             record_timeline: bool = False) -> dict:
    """Run `settings.steps` training steps; returns totals and per-step figures (seconds of
    virtual time). `engine_costs`: a cost model per engine (`megarl.sim.costs`); `trainer`:
    has train_s(trained_tokens, stitch_tokens) and push_s."""
    return vclock.run(_simulate(settings, workload, engine_costs, trainer, record_timeline))


async def _simulate(s: SimSettings, w: Workload, engine_costs, trainer, record_timeline: bool) -> dict:
    loop = asyncio.get_running_loop()
    engines = [SimEngine(f"sim{i}", engine_costs, record_timeline) for i in range(s.engines)]
    pool = EnginePool(engines, timeout_s=float("inf"))
    await pool.start()
    stepper = _stepper(s, w, pool, loop)
    steps = []
    t_begin = loop.time()
    for k in range(s.steps):
        steps.append(await _step(s, k, stepper, pool, trainer, loop))
    wall = loop.time() - t_begin
    stepper.cancel()
    await pool.close()
    return _summary(s, steps, wall, engines, record_timeline)


def _stepper(s: SimSettings, w: Workload, pool: EnginePool, loop) -> RoundStepper:
    """train.py's rounds (rollout/rounds.py) on simulated engines: sync rounds of fresh
    prompts at forced lengths, or the controller with the workload's per-sample budgets."""
    G, n = s.groups_per_step, w.n
    if s.mode == "sync":
        async def fresh(k: int) -> list:
            reqs = [GenRequest(f"s{k}g{g}s{j}", [1] * w.prompt_len(g), w.length_of(g, j), 1.0,
                               ignore_eos=True) for g in range(k * G, (k + 1) * G) for j in range(n)]
            return await asyncio.gather(*(pool.generate(r) for r in reqs))
        return RoundStepper(None, G, asynchronous=False, fresh=fresh)
    counter = iter(range(10**12))

    def new_group():
        gid = next(counter)
        return {"gid": gid}, [1] * w.prompt_len(gid)
    controller = PartialRolloutController(
        pool, n=n, concurrency=s.concurrency, max_new_tokens=w.max_len, temperature=1.0,
        max_staleness=s.max_staleness, stale_policy=s.stale_policy, new_group=new_group,
        score=lambda sample: 0.0, seed=s.seed, budget_of=w.length_of, ignore_eos=True,
        clock=loop.time)
    return RoundStepper(controller, G, asynchronous=s.mode == "async")


async def _step(s: SimSettings, k: int, stepper: RoundStepper, pool: EnginePool, trainer, loop) -> dict:
    """One training step, in train.py's order: round, l_old of the round's new tokens (before
    the weights move), the next round started (async), train, push."""
    t0 = loop.time()
    done = await stepper.round(k)
    if stepper.controller is None:
        tokens, info = [r.versions for r in done], {}
    else:
        tokens, info = [sl.versions for g in done for sl in g.slots], stepper.controller.metrics()
    t_rollout = loop.time() - t0
    pending = stepper.pending()
    stitch = sum(length - len(slot.old_logprobs) for slot, _, length, _ in pending)
    if k + 1 < s.steps:
        stepper.prefetch(k + 1)
    stepper.store([[0.0] * length for _, _, length, _ in pending])
    trained = sum(len(v) for v in tokens)
    t1 = loop.time()
    await asyncio.sleep(trainer.train_s(trained, stitch, samples=len(tokens)))
    t2 = loop.time()
    await asyncio.sleep(trainer.push_s)
    await pool.reload_weights("simulated", k + 1)
    t3 = loop.time()
    staleness = [k - v for vs in tokens for v in vs]
    return {"rollout_s": t_rollout, "train_s": t2 - t1, "push_s": t3 - t2, "step_s": t3 - t0,
            "trained_tokens": trained, "stitch_tokens": stitch,
            "staleness_max": max(staleness, default=0),
            "staleness_mean": sum(staleness) / max(1, len(staleness)),
            **{key: info[key] for key in ("rollout_inflight_mean", "carried_samples",
                                          "restarted_samples", "rollout_requests") if key in info}}


def _summary(s: SimSettings, steps: list[dict], wall: float, engines: list[SimEngine],
             record_timeline: bool) -> dict:
    total = {key: sum(x[key] for x in steps) for key in ("rollout_s", "train_s", "push_s", "trained_tokens")}
    generated = sum(e.log.tokens for e in engines)
    out = {"mode": s.mode, "steps": s.steps, "wall_s": wall, **total,
           "step_s_mean": wall / s.steps,
           "generated_tokens": generated,
           "engine_busy_frac": sum(e.log.busy_s for e in engines) / (wall * len(engines)),
           "trainer_idle_frac": trainer_idle_frac(total["train_s"], wall),
           "trained_tokens_per_s": total["trained_tokens"] / wall,
           "requests": sum(e.log.requests for e in engines),
           "prefill_tokens": sum(e.log.prefill_tokens for e in engines),
           "staleness_max": max(x["staleness_max"] for x in steps),
           "per_step": steps}
    if record_timeline:
        out["timeline"] = {e.name: e.log.timeline for e in engines}
    return out
