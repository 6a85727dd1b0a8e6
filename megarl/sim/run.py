"""`simulate`: megarl's training loop on the virtual clock, with simulated engines and trainer.

What runs is megarl's own code: `EnginePool` (least-loaded placement, versioned updates that
hold the controller, abort, pause, load, resume), `PartialRolloutController` (fixed
concurrency, frontier-first admission, group emission, carry, staleness) and the driver's
stepping `RoundStepper` (megarl/rollout/controller/rounds.py: which round runs when, prefetch, stitching),
unmodified. Only the engines (`SimEngine`) and the trainer (a sleep of its modelled time) are
simulated. A step follows `megarl/train.py`:
- sync: all groups_per_step x n samples of fresh prompts at once; wait for the longest.
- partial: `controller.run_round(groups_per_step, k)`; the rest is carried.
- async: partial, and the round of step k+1 starts as soon as round k ended (the driver's
  `prefetch`), so it generates while the trainer trains; the weight update in between holds
  it (update_mode=abort: aborts what runs, kept as partials; keep: pauses it, held) and
  releases it under the new version.
then: stitched l_old of the carried tokens (partial/async), train, push weights (trainer side,
then `pool.update_weights` on every engine).

`update_mode` / `keep_kv` are rollout.update_mode / rollout.keep_kv, given to the pool: keep
holds the requests over round ends and updates (one request per sample), abort aborts and
resubmits them. `overlap` (rollout.overlap, megarl/ppo/overlap.py): while a round runs, the
trainer (free from the end of its previous step) runs the forward-only passes
(`trainer.forward_s`, its frozen share `trainer.frozen_frac`) of every complete group not yet
trained, one after another in emission order; what the trained groups still lack when the
round ends runs after it with the rest of the step's train time (`_overlap`).
"""
from __future__ import annotations

import asyncio
import copy
import random
from dataclasses import dataclass, field

from megarl.metrics.step import trainer_idle_frac
from megarl.rollout.controller.group_filter import GroupFilter
from megarl.rollout.controller.partial import PartialRolloutController
from megarl.rollout.controller.rounds import RoundStepper
from megarl.rollout.engines.engine import GenRequest
from megarl.rollout.engines.pool import EnginePool
from megarl.sim import clock as vclock
from megarl.sim.engine import SimEngine
from megarl.sim.workload import Workload

MODES = ("sync", "partial", "async")
UPDATE_MODES = ("keep", "abort")


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
    update_mode: str = "keep"                  # rollout.update_mode (the schema's default)
    keep_kv: bool = False                      # rollout.keep_kv
    overlap: bool = False                      # rollout.overlap
    max_step_multiple: int = 8                 # rollout.partial.max_step_multiple (elastic steps; 1: fixed)
    # rollout.group_filter's cost: this share of the completed groups is dropped (drawn per group,
    # seeded), given or measured (a run's filtered_frac); each is generated in full, never trained
    filter_rate: float = 0.0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"simulation mode {self.mode!r}: choose one of {MODES}")
        if self.update_mode not in UPDATE_MODES:
            raise ValueError(f"simulation update_mode={self.update_mode!r}: choose one of {UPDATE_MODES}")
        if self.keep_kv and self.update_mode != "keep":   # the schema's rules of rollout.keep_kv / overlap
            raise ValueError("simulation keep_kv=True: applies only to update_mode=keep; set update_mode=keep "
                             "or keep_kv=False")
        if self.overlap and self.mode == "sync":
            raise ValueError("simulation overlap=True: needs mode partial or async (a sync round hands every "
                             "group over at its end); set overlap=False or another mode")
        for name in ("steps", "groups_per_step", "concurrency", "engines", "max_step_multiple"):
            if getattr(self, name) < 1:
                raise ValueError(f"simulation {name}={getattr(self, name)}: must be >= 1")
        if not 0 <= self.filter_rate < 1:
            raise ValueError(f"simulation filter_rate={self.filter_rate}: must be in [0, 1) (1: no group would "
                             f"ever be trained)")
        if self.mode == "async" and self.max_staleness < 1:   # the rule of rollout.partial.async in the schema
            raise ValueError(f"simulation max_staleness={self.max_staleness}: async mode trains tokens one "
                             f"version old; set it >= 1")


def simulate(settings: SimSettings, workload: Workload, engine_costs, trainer,
             record_timeline: bool = False) -> dict:
    """Run `settings.steps` training steps; returns totals and per-step figures (seconds of
    virtual time). `engine_costs`: a cost model per engine (`megarl.sim.costs`); `trainer`:
    has train_s(trained_tokens, stitch_tokens, samples) and push_s, and with overlap
    forward_s(trained_tokens, samples)."""
    if settings.overlap and not hasattr(trainer, "forward_s"):
        raise ValueError(f"simulation overlap=True: the trainer model {type(trainer).__name__} has no "
                         f"forward_s (its forward-only passes); use megarl.sim.costs' trainers")
    return vclock.run(_simulate(settings, workload, engine_costs, trainer, record_timeline))


@dataclass
class _Trace:
    """What the steps need across steps: when each group was emitted (the controller scores
    every sample of a group at once, on the loop: `score` sees them; a group leaves when it is
    trained), the trainer's free time, its passes of those groups, and the samples sent (each
    sample's first request: its prompt tokens prefilled once)."""
    clock: object
    emitted: dict = field(default_factory=dict)   # gid -> [time, response tokens, samples, their lengths]
    trainer_free: float = 0.0
    cache: dict = field(default_factory=dict)     # gid -> _Cached (rollout.overlap)
    first_prefill: int = 0
    samples_started: int = 0
    resent_prompt: int = 0       # prompt tokens of requests sent again for a sample (continuations, restarts)
    engines: list = field(default_factory=list)
    filtered: int = 0            # groups the modelled group filter dropped (SimSettings.filter_rate)
    # the engines' logs before the run's last weight update: what that update causes (abort
    # mode's continuations, keep_kv=false's recompute) happens after the run, so neither mode
    # counts it (the other figures read the logs at the end)
    logs_before_last_update: list = field(default_factory=list)

    def started(self, groups) -> None:
        """Count the samples of `groups` that were sent at least once."""
        for g in groups:
            sent = sum(1 for sl in g.slots if sl.attempts)
            self.samples_started += sent
            self.first_prefill += len(g.prompt_ids) * sent
            self.resent_prompt += len(g.prompt_ids) * sum(max(0, sl.attempts - 1) for sl in g.slots)

    def score(self, sample) -> float:
        rec = self.emitted.setdefault(sample.uid, [self.clock(), 0, 0, []])
        rec[1] += len(sample.response_ids)
        rec[2] += 1
        rec[3].append(len(sample.response_ids))
        return 0.0


async def _simulate(s: SimSettings, w: Workload, engine_costs, trainer, record_timeline: bool) -> dict:
    loop = asyncio.get_running_loop()
    engines = [SimEngine(f"sim{i}", engine_costs, record_timeline) for i in range(s.engines)]
    pool = EnginePool(engines, timeout_s=float("inf"), update_mode=s.update_mode, keep_kv=s.keep_kv)
    await pool.start()
    trace = _Trace(loop.time, engines=engines)
    stepper = _stepper(s, w, pool, loop, trace)
    steps = []
    t_begin = loop.time()
    trace.trainer_free = t_begin
    for k in range(s.steps):
        steps.append(await _step(s, k, stepper, pool, trainer, loop, trace))
    wall = loop.time() - t_begin
    stepper.cancel()
    # requests still held (keep mode) or carried resolve now, so no task outlives the loop
    await pool.abort()
    for _ in range(3):
        await asyncio.sleep(0)
    if stepper.controller is not None:   # samples started but never trained: their first prefill too
        c = stepper.controller
        trace.started([*c.groups.values(), *c.completed, *c.ready])
    await pool.close()
    out = _summary(s, steps, wall, engines, record_timeline, trace)
    out.update(ideal_rollout(s, w, engine_costs, out))
    return out


def ideal_rollout(s: SimSettings, w: Workload, engine_costs, out: dict) -> dict:
    """The rollout time of the trained tokens with every engine full (concurrency / engines
    requests each, at the trained samples' mean context, no prefill), and each mode's ceiling
    in seconds per `groups_per_step` groups: train + push + ideal rollout (sync, partial: the
    engines idle while the trainer trains), max(train + push, ideal rollout) (async: they
    overlap). Figures per `groups_per_step` groups, so modes whose steps train more compare."""
    units = max(1e-9, out["trained_samples"] / (s.groups_per_step * w.n))
    per_engine = max(1.0, s.concurrency / s.engines)
    mean_len = out["trained_tokens"] / max(1, out["trained_samples"])
    context = per_engine * (w.prompt_len(0) + mean_len / 2)
    ideal = out["trained_tokens"] / (per_engine * s.engines) * engine_costs.step_s(round(per_engine), context, 0, 0)
    train, push = out["train_s"] / units, out["push_s"] / units
    floor = max(train + push, ideal / units) if s.mode == "async" else train + push + ideal / units
    return {"units": units, "groups_trained": out["trained_samples"] / w.n,
            "unit_s": out["wall_s"] / units, "ideal_rollout_s": ideal,
            "ideal_unit_s": floor, "rollout_unit_s": out["rollout_s"] / units,
            "train_unit_s": train, "push_unit_s": push}


def _dropped(s: SimSettings, gid: int) -> bool:
    """The modelled group filter's verdict on group `gid` (dropped with probability filter_rate)."""
    return s.filter_rate > 0 and random.Random(s.seed * 1_000_003 + gid).random() < s.filter_rate


def _stepper(s: SimSettings, w: Workload, pool: EnginePool, loop, trace: _Trace) -> RoundStepper:
    """train.py's rounds (rollout/controller/rounds.py) on simulated engines: sync rounds of fresh
    prompts at forced lengths (with a filter rate: drawn again for the dropped groups, as
    group_filter.fill_groups does), or the controller with the workload's per-sample budgets."""
    G, n = s.groups_per_step, w.n
    counter = iter(range(10**12))
    if s.mode == "sync":
        async def fresh(k: int) -> list:
            out, need = [], G
            while need:
                gids = [next(counter) for _ in range(need)]
                reqs = [GenRequest(f"s{k}g{g}s{j}", [1] * w.prompt_len(g), w.length_of(g, j), 1.0,
                                   ignore_eos=True) for g in gids for j in range(n)]
                trace.first_prefill += sum(len(r.prompt_ids) for r in reqs)
                trace.samples_started += len(reqs)
                results = await asyncio.gather(*(pool.generate(r) for r in reqs))
                kept = [not _dropped(s, g) for g in gids]
                out += [r for i, r in enumerate(results) if kept[i // n]]
                trace.filtered += kept.count(False)
                need -= sum(kept)
            return out
        return RoundStepper(None, G, asynchronous=False, fresh=fresh)

    def keep(samples) -> bool:
        gid = samples[0].uid
        if not _dropped(s, gid):
            return True
        trace.emitted.pop(gid, None)
        trace.filtered += 1
        return False

    def new_group():
        gid = next(counter)
        return {"gid": gid}, [1] * w.prompt_len(gid)
    controller = PartialRolloutController(
        pool, n=n, concurrency=s.concurrency, max_new_tokens=w.max_len, temperature=1.0,
        max_staleness=s.max_staleness, stale_policy=s.stale_policy, new_group=new_group,
        score=trace.score, seed=s.seed, budget_of=w.length_of, ignore_eos=True,
        clock=loop.time, step_multiple=s.max_step_multiple,
        group_filter=GroupFilter("sim", keep, max_draws=10**9) if s.filter_rate else None)
    return RoundStepper(controller, G, asynchronous=s.mode == "async")


@dataclass
class _Cached:
    """The passes the trainer has of one complete group (ppo/overlap.py's PassCache)."""
    frozen: bool = False       # the frozen models' (reference): kept over weight updates
    version: int = -1          # the weight version of its trained models' passes (old logprobs, values)


def _overlap(groups: list[tuple[float, int]], free_at: float, round_end: float, version: int,
             cache: dict, cost) -> tuple[float, float]:
    """The trainer's passes while a round runs, as `Overlap.serve` does them: from `free_at`
    (the end of its previous step) on, one resource, it takes every complete group not yet
    trained (`groups`: (emitted at, gid); the ones this step trains and the ones left for later
    steps alike) in emission order and runs the passes it lacks at `version`: the trained
    models' unless cached at this version, the frozen models' unless cached at all. A group
    started before `round_end` is finished. `cost(gid)` -> (trained models' s, frozen models'
    s). Marks `cache`; returns the trainer's seconds (before round_end, after it)."""
    t, busy = free_at, 0.0
    for ready, gid in sorted(groups):
        start = max(t, ready)
        if start >= round_end:
            break
        c = cache.setdefault(gid, _Cached())
        versioned, frozen = cost(gid)
        need = (versioned if c.version != version else 0.0) + (frozen if not c.frozen else 0.0)
        c.version, c.frozen = version, True
        t = start + need
        busy += need
    tail = max(0.0, t - round_end) if busy else 0.0
    return busy - tail, tail


def _overlap_step(k: int, done: list, t_end: float, trainer, trace: "_Trace") -> tuple[float, float, float]:
    """rollout.overlap in step k: (trainer seconds during the round, seconds of a pass it
    finishes after the round, seconds of the trained groups' passes it need not run after the
    round). The trained groups leave the cache; the others keep only their frozen passes' value
    (a version check: the next step's weights are k + 1)."""
    def cost(gid: int) -> tuple[float, float]:
        _, tokens, samples, lengths = trace.emitted[gid]
        f = trainer.forward_s(tokens, samples, lengths=lengths)
        return f * (1 - trainer.frozen_frac), f * trainer.frozen_frac
    during, tail = _overlap([(at, gid) for gid, (at, *_) in trace.emitted.items()], trace.trainer_free,
                            t_end, k, trace.cache, cost)
    hidden = 0.0
    for g in done:
        c = trace.cache.pop(g.gid, None)
        if c is not None:
            versioned, frozen = cost(g.gid)
            hidden += (versioned if c.version == k else 0.0) + (frozen if c.frozen else 0.0)
    return during, tail, hidden


async def _step(s: SimSettings, k: int, stepper: RoundStepper, pool: EnginePool, trainer, loop,
                trace: _Trace) -> dict:
    """One training step, in train.py's order: round, l_old of the round's new tokens (before
    the weights move), the next round started (async), train (less what overlapped the round),
    push."""
    t0 = loop.time()
    done = await stepper.round(k)
    t_end = loop.time()
    if stepper.controller is None:
        tokens, info = [r.versions for r in done], {}
        requests = len(done)
    else:
        tokens, info = [sl.versions for g in done for sl in g.slots], stepper.controller.metrics()
        trace.started(done)
        requests = sum(sl.attempts for g in done for sl in g.slots)
    t_rollout = t_end - t0
    pending = stepper.pending()
    stitch = sum(length - len(slot.old_logprobs) for slot, _, length, _ in pending)
    if k + 1 < s.steps:
        stepper.prefetch(k + 1)
    stepper.store([[0.0] * length for _, _, length, _ in pending])
    trained = sum(len(v) for v in tokens)
    during = tail = hidden = 0.0
    if s.overlap:
        during, tail, hidden = _overlap_step(k, done, t_end, trainer, trace)
    for g in done if stepper.controller is not None else ():
        trace.emitted.pop(g.gid, None)
    t1 = loop.time()
    lengths = [len(v) for v in tokens]
    await asyncio.sleep(trainer.train_s(trained, stitch, samples=len(tokens), lengths=lengths) - hidden + tail)
    t2 = loop.time()
    await asyncio.sleep(trainer.push_s)
    if k + 1 == s.steps:
        trace.logs_before_last_update = [copy.copy(e.log) for e in trace.engines]
    await pool.reload_weights("simulated", k + 1)
    t3 = loop.time()
    trace.trainer_free = t3
    staleness = [k - v for vs in tokens for v in vs]
    # overlap_s: the trainer's work during the round (also passes of groups trained later);
    # overlap_hidden_s: the trained groups' passes it had done (train_s is that much shorter,
    # plus overlap_after_s, a pass it finished after the round)
    return {"rollout_s": t_rollout, "train_s": t2 - t1, "overlap_s": during, "overlap_hidden_s": hidden,
            "overlap_after_s": tail, "push_s": t3 - t2,
            "step_s": t3 - t0, "trained_tokens": trained, "trained_samples": len(tokens),
            # positions the update computes (prompt + response, with the trainer's padding) and
            # the real ones: a trainer that models no padding (no `positions`) computes the real
            **_positions(trainer, trained, lengths),
            "trained_sample_requests": requests,   # requests sent for the samples trained
            "stitch_tokens": stitch, "staleness_max": max(staleness, default=0),
            "staleness_mean": sum(staleness) / max(1, len(staleness)),
            "multi_version_sample_tokens": sum(len(v) for v in tokens if len(set(v)) > 1),
            **{key: info[key] for key in ("rollout_inflight_mean", "carried_samples",
                                          "restarted_samples", "rollout_requests") if key in info}}


def _positions(trainer, trained: int, lengths: list[int]) -> dict:
    if not hasattr(trainer, "positions"):
        return {"update_positions": trained, "real_positions": trained}
    return {"update_positions": trainer.positions(trained, len(lengths), lengths)[0],
            "real_positions": trainer.positions(trained, len(lengths), None)[0]}


def _summary(s: SimSettings, steps: list[dict], wall: float, engines: list[SimEngine],
             record_timeline: bool, trace: _Trace) -> dict:
    keys = ("rollout_s", "train_s", "overlap_s", "overlap_hidden_s", "push_s", "trained_tokens", "trained_samples",
            "trained_sample_requests", "multi_version_sample_tokens", "update_positions", "real_positions")
    total = {key: sum(x[key] for x in steps) for key in keys}
    logs = [e.log for e in engines]
    before = trace.logs_before_last_update or logs
    requests = sum(x.requests for x in before)
    prefill = sum(x.prefill_tokens for x in before)
    out = {"mode": s.mode, "update_mode": s.update_mode, "keep_kv": s.keep_kv, "overlap": s.overlap,
           "steps": s.steps, "wall_s": wall, **total,
           "step_s_mean": wall / s.steps,
           "generated_tokens": sum(x.tokens for x in logs),
           "engine_busy_frac": sum(x.busy_s for x in logs) / (wall * len(engines)),
           # the trainer works train_s after the rounds and overlap_s during them
           "trainer_idle_frac": trainer_idle_frac(total["train_s"], wall, total["overlap_s"]),
           "trained_tokens_per_s": total["trained_tokens"] / wall,
           # positions the trainer's updates compute per real one (its padding, the busiest DP rank)
           "computed_per_real": total["update_positions"] / max(1, total["real_positions"]),
           "requests": requests,
           "samples_started": trace.samples_started,   # trained, or still open when the run ended
           # keep mode: 1 (each sample's one request lives through the updates); abort: more
           "requests_per_trained_sample": total["trained_sample_requests"] / max(1, total["trained_samples"]),
           "prefill_tokens": prefill,
           # prefilled beyond each sample's first prompt: continuations (abort mode: prompt +
           # tokens so far, sent again), restarts, and held context whose KV clear_kv() dropped
           "reprefill_tokens": prefill - trace.first_prefill,
           "kv_recomputed_tokens": sum(x.reprefill_tokens for x in before),
           # of those the generated tokens only (the controller's reprefill_tokens counts these)
           "kv_recomputed_response_tokens": sum(x.reprefill_response_tokens for x in before),
           # of those: generated tokens sent again in continuations' prompts (what the controller's
           # reprefill_tokens counts in abort mode; it adds the pool's recomputed KV in keep mode)
           "resent_tokens": prefill - trace.first_prefill - trace.resent_prompt
           - sum(x.reprefill_tokens for x in before),
           # requests whose own tokens span weight versions (held over an update), and their tokens
           "multi_version_requests": sum(x.multi_version_requests for x in before),
           "multi_version_tokens": sum(x.multi_version_tokens for x in before),
           "staleness_max": max(x["staleness_max"] for x in steps),
           "filter_rate": s.filter_rate, "groups_filtered": trace.filtered,
           "per_step": steps}
    if record_timeline:
        out["timeline"] = {e.name: e.log.timeline for e in engines}
    return out
