"""What the driver asks of the rollout each step, whatever `rollout.mode` is.

`Rollout.round(step)` returns the step's samples (train.groups_per_step groups of rollout.sampling.n;
partial mode: a whole multiple of them, up to rollout.partial.max_step_multiple, elastic steps)
and its metrics; `pending()` the partial samples whose newest tokens still need the trainer's
logprobs (stitching, partial mode only) and `store(...)` takes them back; `state_dict()` is
what a checkpoint keeps (the data cursor and, in partial mode, the whole carry).
- sync: every sample of `groups_per_step` fresh prompts, the step waits for the longest one.
- partial: the controller (`controller.py`) on the pool's event loop.
- partial + rollout.partial.async: `prefetch(step + 1)` starts the next round right after this one
  ended, so it generates (under the current weights, then under the new ones after the
  mid-round sync) while the trainer trains; `round()` then only waits for what is missing.
The stepping itself (which round runs when, what is pending, where stitched values go) is
`RoundStepper`, on the event loop: the driver runs it through the pool's loop thread, the
simulator (megarl/sim/run.py) on its virtual clock, so both step the same way.
Runs on trainer rank 0 only. Everything that touches the controller's state runs on the
pool's event loop thread (the controller is not thread-safe); the driver thread only sees
copies. A round's groups stay on the controller (`ready`) until the driver takes them on the
loop, so a checkpoint taken at any moment holds each untrained group exactly once. Scoring
(the verifier) runs in the reward runner, off the loop: the engines are served meanwhile.
"""
from __future__ import annotations

import asyncio
import bisect
import copy
import time
from collections import Counter
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait
from typing import Awaitable, Callable

from megarl.data.prompts import encode_prompts
from megarl.data.sample import Sample
from megarl.data.seeds import group_seed, step_prompt_seeds
from megarl.envs.base import env_spec
from megarl.envs.episodes import EpisodeDriver
from megarl.rollout import routes
from megarl.rollout.controller import group_filter, staleness
from megarl.rollout.controller.partial import PartialRolloutController
from megarl.rollout.controller.scoring import score_all, score_group
from megarl.rollout.controller.sync_rollout import generate_groups


def episode_driver(env, tokenizer) -> EpisodeDriver:
    """The controller's environments for env.*."""
    return EpisodeDriver(env_spec(env.name), tokenizer, max_turns=env.max_turns, timeout_s=env.timeout_s,
                         options=dict(env.options), template=env.template)


class RoundStepper:
    """One round per training step, on the engine pool's event loop (its methods run there).

    sync (`controller` None): `round(k)` is `fresh(k)`, a round of fresh prompts; nothing is
    carried. partial: `round(k)` is the controller's round of `groups` groups for step k (the
    one `prefetch(k)` started, if any), taken from it. async (`asynchronous`): the driver calls
    `prefetch(k + 1)` as soon as round k ended, so round k+1 generates while step k trains.
    After a round, `pending()` lists the slots whose new tokens need the trainer's logprobs
    under the current weights and `store(values)` puts them into those slots."""

    def __init__(self, controller: PartialRolloutController | None, groups: int, asynchronous: bool,
                 fresh: Callable[[int], Awaitable[list]] | None = None):
        self.controller, self.groups, self.asynchronous = controller, groups, asynchronous
        self.fresh = fresh
        self._next: asyncio.Future | None = None     # the prefetched round (async mode)
        self._wanted: asyncio.Event | None = None    # set when its step asks for it: it may end then
        self._pending: list = []

    async def round(self, step: int) -> list:
        """sync: what `fresh(step)` returns; partial: the round's groups (the controller's)."""
        if self.controller is None:
            return await self.fresh(step)
        started = self._next or asyncio.ensure_future(self.controller.run_round(self.groups, step))
        if self._wanted is not None:   # a prefetched round generated while the trainer trained: it may end now
            self._wanted.set()
        self._next = self._wanted = None
        await started
        return self.controller.take_ready()

    def prefetch(self, step: int) -> None:
        """Async mode: start the round of `step` now (the trainer is about to train)."""
        if self.controller is not None and self.asynchronous:
            # elastic steps: the round generates until its step asks for it, then takes every
            # complete group it may; fixed steps: it ends as soon as it has its groups
            self._wanted = asyncio.Event() if self.controller.step_multiple > 1 else None
            self._next = asyncio.ensure_future(self.controller.run_round(self.groups, step, self._wanted))

    def pending(self) -> list[tuple]:
        """(slot, restarts, length, sample) of each slot whose tokens of this round need l_old
        before the weights change; call between rounds, before `prefetch`."""
        self._pending = [] if self.controller is None else self.controller.pending_old_logprobs()
        return self._pending

    def store(self, old_logprobs: list[list[float]]) -> None:
        """The trainer's logprobs of the slots `pending()` listed, in its order."""
        for (slot, restarts, length, _), values in zip(self._pending, old_logprobs):
            self.controller.store_old_logprobs(slot, restarts, length, values)
        self._pending = []

    def cancel(self) -> None:
        """Drop a prefetched round nobody will train (the last step's, at the end of a run)."""
        if self._next is not None:
            self._next.cancel()
            self._next = self._wanted = None


class Rollout:
    """The driver's rollout (trainer rank 0, its own thread): `RoundStepper` run on the pool's
    loop thread, the samples and metrics of each round, the state a checkpoint keeps."""

    def __init__(self, cfg, pool, records: list[dict], sampler, tokenizer, reward_fn: Callable,
                 service_factory: Callable | None = None):
        self.cfg, self.pool, self.records, self.sampler = cfg, pool, records, sampler
        self.tokenizer, self.reward_fn = tokenizer, reward_fn
        r = cfg.rollout
        self.controller = self.episodes = self.service = None
        # rollout.group_filter: each group judged as it is scored (controller/group_filter.py)
        self.group_filter = group_filter.build(r.group_filter, r.group_filter_max_draws)
        if r.mode == "service":   # outside agents run the episodes against the policy's endpoint
            # made above rollout (megarl/service/launch.py imports rollout, not the other way)
            self.service = service_factory(self._next_task)
            if self.group_filter.active:   # judged where the agents' episodes complete a group
                self.service.book.keep = self.group_filter.judge
        if r.mode == "partial":
            if cfg.env.name:   # episodes: the environment's rewards are the score (nothing to run)
                self.episodes = episode_driver(cfg.env, tokenizer)
                score, scorer = (lambda s: s.reward), None
            else:   # each complete group awaited on the loop, scored off it by the reward runner
                # (reward.concurrency calls at once, batched ones with whole groups)
                score = None

                async def scorer(samples: list[Sample]) -> list[float]:
                    return await score_group(samples, tokenizer, reward_fn)
            self.controller = PartialRolloutController(
                pool.pool, n=r.sampling.n, concurrency=r.partial.concurrency,
                max_new_tokens=r.sampling.max_new_tokens, temperature=r.sampling.temperature,
                top_p=r.sampling.top_p, top_k=r.sampling.top_k,
                max_staleness=r.partial.max_staleness, stale_policy=r.partial.stale_policy,
                new_group=self._new_group, score=score, seed=cfg.run.seed, scorer=scorer,
                episodes=self.episodes, loop=pool.loop.loop, step_multiple=r.partial.max_step_multiple,
                group_filter=self.group_filter)
        # sync mode: `_fresh` runs on the loop thread like the controller's rounds (and the
        # simulator's); its samples are scored back on the driver thread
        self.stepper = RoundStepper(self.controller, cfg.train.groups_per_step, r.partial.asynchronous,
                                    fresh=self._fresh)

    def _new_group(self) -> tuple[dict, list[int]]:
        record = self.records[self.sampler.take(1)[0]]
        return record, encode_prompts(self.tokenizer, [record], self.cfg.data)[0]

    def _next_task(self) -> tuple[dict, int]:
        """rollout.mode=service: the next record of the data stream and its uid (on the loop)."""
        uid = self.sampler.drawn
        return self.records[self.sampler.take(1)[0]], uid

    def _service_round(self, step: int) -> tuple[list[Sample], dict]:
        k, wait_s = self.cfg.train.groups_per_step, self.cfg.service.wait_s

        p = self.cfg.rollout.partial

        def stale(sample) -> bool:   # the controller's bound (megarl/service/bound.py)
            return staleness.stale_sample(sample, step, p.max_staleness)

        async def take():   # on the loop, where the agents' calls change the service
            groups = await self.service.take_groups(k, stale, p.stale_policy == "drop")
            return groups, {**self.service.metrics(), **self.group_filter.since_last(len(groups))}

        async def read():
            return self.service.metrics()
        future = self.pool.loop.submit(take())
        try:
            groups, metrics = future.result(wait_s)
        except FutureTimeout:
            future.cancel()
            raise TimeoutError(f"step {step}: the agents at {self.service.url} brought fewer than {k} complete "
                               f"groups within service.wait_s={wait_s:g} s ({self.pool.call(read(), 'reading')}): "
                               f"are they running and reporting rewards? Raise service.wait_s for slow "
                               f"episodes") from None
        samples = [s for g in groups for s in g]
        return samples, {**metrics, **trained_metrics(samples, step), **self._engine_metrics()}

    def round(self, step: int, during: Callable | None = None) -> tuple[list[Sample], dict]:
        """The round's samples and metrics. `during(finished, emitted)` (partial mode; the
        intra-step overlap, ppo/overlap.py `Overlap.serve`) runs on this thread while the round
        runs: `finished(timeout)` waits up to `timeout` s and says whether it ended,
        `emitted(seen)` is (the uids of every complete, scored group not taken by a step; the
        samples of those among the first train.groups_per_step x rollout.partial.max_step_multiple
        (the most a step trains) in the order the step takes
        groups, due ones then the oldest, whose uid is not in `seen`), read on the loop thread.
        Once the round ended its groups are taken: the uids are then those left waiting."""
        if self.service is not None:
            return self._service_round(step)
        if self.controller is None:
            return self._sync_round(step)
        deadline = self.pool.pool.timeout_s * max(4, self.cfg.rollout.sampling.max_new_tokens)
        if during is None:
            samples, metrics = self.pool.call(self._partial_round(step), f"rollout round {step}", deadline)
        else:
            samples, metrics = self._round_during(step, deadline, during)
        # the trainer's weights at step k are version k
        return samples, {**metrics, **trained_metrics(samples, step), **self._engine_metrics()}

    def _sync_round(self, step: int) -> tuple[list[Sample], dict]:
        """Sync mode: fresh prompts generated and scored; with a group filter, replacements for
        the dropped groups until train.groups_per_step pass (group_filter.fill_groups)."""
        version, n = self.pool.version, self.cfg.rollout.sampling.n

        def draw(groups: int, k: int) -> list[list[Sample]]:
            count = groups * n
            coro = self.stepper.round(step) if k == 0 else self._fresh(step, groups, k)
            samples = self.pool.call(coro, f"generating {count} samples", self.pool.pool.deadline_for(count))
            score_all(samples, self.tokenizer, self.reward_fn)
            return [samples[i * n:(i + 1) * n] for i in range(groups)]
        groups, metrics = group_filter.fill_groups(draw, self.cfg.train.groups_per_step, self.group_filter, step)
        samples = [s for g in groups for s in g]
        metrics["groups_filtered_total"] = self.group_filter.filtered_total
        return samples, {**metrics, **trained_metrics(samples, version), **self._engine_metrics()}

    async def _partial_round(self, step: int) -> tuple[list[Sample], dict]:
        """On the loop: the round's groups, taken, as samples (copies), and the controller's
        metrics, read there (held requests and scorings change the controller meanwhile)."""
        done = await self.stepper.round(step)
        samples = [s for i, g in enumerate(done) for s in self.controller.samples_of(g, i)]
        return samples, self.controller.metrics()

    def _round_during(self, step: int, deadline: float, during: Callable) -> tuple[list[Sample], dict]:
        future = self.pool.loop.submit(self._partial_round(step))
        end = time.monotonic() + deadline
        what = f"rollout round {step}"

        def finished(timeout: float) -> bool:
            if time.monotonic() > end:   # past the round's deadline: the same error as without overlap
                self.pool.loop.wait(future, 0, what)
            wait([future], timeout)
            return future.done()
        during(finished, lambda seen: self.pool.call(self._emitted(seen, step), f"reading the groups of {what}"))
        return self.pool.loop.wait(future, max(1.0, end - time.monotonic()), what)

    async def _emitted(self, seen: set, step: int) -> tuple[list[int], list[list[Sample]]]:
        """On the loop: the uids of the complete, untaken groups, and the samples of those that
        step `step` may still train, in the order it takes them (due ones, then the oldest).
        The step takes the first groups_per_step complete groups in that order when the round
        ends, and the round waits for every due group: a complete group with groups_per_step
        or more ahead of it (complete ones, and open ones already due) is never trained by
        this step, so its passes would be wasted."""
        def key(g):
            return staleness.training_order(g, step)
        groups = sorted([*self.controller.ready, *self.controller.completed], key=key)
        due_open = sorted(key(g) for g in self.controller.groups.values() if not key(g)[0])
        target = self.cfg.train.groups_per_step * self.controller.step_multiple   # the most a step trains
        fresh = [self.controller.samples_of(g) for i, g in enumerate(groups)
                 if i + bisect.bisect_left(due_open, key(g)) < target and g.gid not in seen]
        return [g.gid for g in groups], fresh

    async def _fresh(self, step: int, groups: int = 0, draw: int = 0) -> list[Sample]:
        """Sync mode, on the loop: every sample of groups_per_step (or `groups`) fresh prompts,
        unscored, seeded by (run seed, step); a group filter's later `draw`s of the step by
        (run seed, the prompt's place in the data stream)."""
        r = self.cfg.rollout
        first_uid = self.sampler.drawn
        chosen = [self.records[i] for i in self.sampler.take(groups or self.cfg.train.groups_per_step)]
        prompts = encode_prompts(self.tokenizer, chosen, self.cfg.data)
        seeds = step_prompt_seeds(self.cfg.run.seed, step, len(chosen)) if not draw else \
            [group_seed(self.cfg.run.seed, first_uid + i) for i in range(len(chosen))]
        return await generate_groups(self.pool.pool, chosen, prompts, r.sampling.n, r.sampling.max_new_tokens,
                                     seeds, r.sampling.temperature, tag=f"{step}-{draw}-" if draw else f"{step}-",
                                     first_uid=first_uid, top_p=r.sampling.top_p, top_k=r.sampling.top_k)

    def _engine_metrics(self) -> dict:
        """Engines retired and restarted so far, requests sent again to an engine that answered
        a server error (each event is also logged when it happens)."""
        pool = self.pool.pool
        return {"engine_failures": len(pool.failures), "engines_alive": len(pool.engines),
                "engine_restarts": pool.restarts, "engine_retries": pool.retries}

    def prefetch(self, step: int) -> None:
        """Async mode: start the round of `step` now (the trainer is about to train)."""
        if self.controller is not None and self.cfg.rollout.partial.asynchronous:
            async def start():
                self.stepper.prefetch(step)
            self.pool.call(start(), f"starting rollout round {step}")

    def pending(self) -> list[Sample]:
        """Partial samples whose tokens of this round need l_old before the weights change."""
        if self.controller is None:
            return []

        async def read():   # on the loop: the controller's state changes there (never idle in keep mode)
            return [sample for *_, sample in self.stepper.pending()]
        return self.pool.call(read(), "listing the carry's tokens for l_old")

    def store(self, old_logprobs: list[list[float]]) -> None:
        async def put():   # on the loop thread: a prefetched round may be mutating slots
            self.stepper.store(old_logprobs)
        self.pool.call(put(), "storing old logprobs")

    async def snapshot(self) -> tuple[dict, dict]:
        """On the loop: the controller's and the sampler's state, as copies. A running
        (prefetched) round is held meanwhile: no request may be in flight, no group half-scored;
        an ended round's untaken groups are in the controller's state (`ready`)."""
        await self.controller.hold(scoring=True)
        try:
            return copy.deepcopy(self.controller.state_dict()), copy.deepcopy(self.sampler.state_dict())
        finally:
            self.controller.release()

    def state_dict(self) -> dict:
        if self.service is not None:
            async def read():   # on the loop: the agents' calls change both meanwhile
                return copy.deepcopy({"sampler": self.sampler.state_dict(), "service": self.service.state_dict(),
                                      "filter": self.group_filter.state_dict()})
            return self.pool.call(read(), "saving the rollout service's state")
        if self.controller is None:   # the controller's state holds its filter's counts
            return {"sampler": self.sampler.state_dict(), "filter": self.group_filter.state_dict()}
        controller, sampler = self.pool.call(self.snapshot(), "saving the rollout state")
        return {"sampler": sampler, "controller": controller}

    def close(self) -> None:
        if self.episodes is not None:
            self.episodes.close()
        if self.service is not None:
            self.pool.call(self.service.close(), "stopping the rollout service")

    def load_state_dict(self, state: dict) -> None:
        async def put():   # on the loop, where the sampler, the controller and the service are used
            self.sampler.load_state_dict(state["sampler"])
            if self.controller is None:
                self.group_filter.load_state_dict(state.get("filter"))
            if self.controller is not None and "controller" in state:
                self.controller.load_state_dict(state["controller"])
            if self.service is not None and "service" in state:
                self.service.load_state_dict(state["service"])
        self.pool.call(put(), "restoring the rollout state")


def trained_metrics(samples: list[Sample], version: int) -> dict:
    """Metrics of the step's trained samples: token staleness, and the routes' bytes when the
    engines captured them (routing replay)."""
    return {**staleness_metrics(samples, version), **routes.metrics(samples),
            "zero_advantage_groups_frac": group_filter.zero_advantage_frac(samples)}


def staleness_metrics(samples: list[Sample], version: int) -> dict:
    """Histogram of token staleness (trained version - producing version) over the step's
    trained tokens (an episode's observation tokens are context, not the policy's)."""
    counts = Counter(version - v for s in samples for v, m in zip(s.versions, s.loss_mask) if m)
    total = max(1, sum(counts.values()))
    out = {f"staleness_frac_{k}": counts[k] / total for k in sorted(counts)}
    out["staleness_max"] = max(counts) if counts else 0
    out["staleness_mean"] = sum(k * c for k, c in counts.items()) / total
    out["samples_spanning_versions"] = sum(len({v for v, m in zip(s.versions, s.loss_mask) if m}) > 1
                                           for s in samples)
    return out
