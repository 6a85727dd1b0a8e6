"""The partial-rollout controller: fixed concurrency, group emission, carry-over, bounded staleness.

One round (docs/design.md "One training step"; docs/partial_rollout.md), on the pool's event loop
(trainer rank 0):
- up to `rollout.partial.concurrency` sample requests stay in flight across the engines while the
  round runs; a finished request is replaced at once (the pool sends it to the least-loaded
  engine).
- admission is frontier-first: samples the staleness bound says must finish this step, then
  carried samples (tokens already generated), then waiting samples of the groups closest to
  completion, then a new group (n samples of one prompt).
- a group whose n samples are all done (stopped, or at the token budget) is scored (off
  the loop when a `scorer` executor is given) and queued for the trainer.
- the round ends when `train.groups_per_step` groups are complete AND every group due this
  step (below) is complete. What is still in flight is carried (`pool.update_mode`,
  rollout.update_mode): keep (default) pauses the engines with the requests held; their tokens,
  behaviour logprobs and versions so far are copied into their slots (`pool.partial`), and
  after the weight update the same requests go on under the new version (no resubmission, no
  re-prefill). abort aborts them; their partials stay in their slots and each is sent again
  as a continuation (prompt + tokens so far) in a later round. The round's groups stay in
  `ready` until the driver takes them (`take_ready`), so a snapshot taken at any moment holds
  every untrained group exactly once.
- any exception (engine, scoring, the data stream, building a request) ends the round at once
  and is raised by `run_round`.

Staleness (`rollout.partial.stale_policy`, megarl/rollout/staleness.py): by default (`finish`) every
group gets a deadline step when it opens, admission waits while no step within the bound has
room, and a round may not end while a group due at its step is incomplete: long samples are
finished, never discarded. `restart` / `drop` (opt-in) discard stale samples instead and
report what that cost (`stale_tokens_discarded`).

Stitched old logprobs (CoPRIS): `Slot.old_logprobs` holds the trainer's logprob of each token
under the version that produced it. At the end of every round the trainer computes them for
the tokens generated in that round (of carried and done samples alike) before its weights
change; `PPO` then uses the stored values instead of recomputing them under newer weights.

Everything here is plain data: `state_dict()` holds the open groups with every slot's tokens,
logprobs, versions and stored old logprobs, the completed-but-untrained groups (the last
round's untaken result first) and the group counter, as lists and numbers.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from megarl.data import seeds
from megarl.data.sample import Sample
from megarl.distributed import faults
from megarl.rollout import staleness
from megarl.rollout.engine import EngineError, GenRequest, GenResult

STALE_POLICIES = staleness.POLICIES


@dataclass
class Slot:
    """One sample of a group: what has been generated for it so far."""
    gid: int
    index: int
    seed: int                                               # seeds.sample_seed of its group's seed and index
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)    # behaviour (engine) logprobs
    versions: list[int] = field(default_factory=list)      # version that produced each token
    old_logprobs: list[float] = field(default_factory=list)  # trainer l_old, stitched (a prefix)
    finish_reason: str = ""                                 # "" until stop | length (then done)
    restarts: int = 0
    attempts: int = 0                                       # requests sent (unique request keys)
    # multi-turn episodes (megarl/envs/episodes.py); unused by single-turn samples
    mask: list[int] = field(default_factory=list)           # 1 model token, 0 observation token
    turns: int = 0                                          # model turns the environment answered
    turn_spans: list[list[int]] = field(default_factory=list)  # [start, end) of each such turn
    turn_base: int = 0                                      # where the current model turn began
    env_reward: float = 0.0                                 # the environment's rewards so far
    env_status: str = ""                                    # "" | error | timeout (reward 0)

    @property
    def done(self) -> bool:
        """Nothing left to generate: stopped (EOS / stop string) or at its token budget."""
        return self.finish_reason in ("stop", "length")

    def restart(self) -> int:
        """Forget everything generated; returns how many tokens were thrown away."""
        lost = len(self.response_ids)
        self.response_ids, self.logprobs, self.versions, self.old_logprobs = [], [], [], []
        self.mask, self.turn_spans, self.turns, self.turn_base = [], [], 0, 0
        self.env_reward, self.env_status = 0.0, ""
        self.finish_reason = ""
        self.restarts += 1
        return lost

    def clip(self, budget: int) -> None:
        """Keep at most `budget` tokens, done on length (a carry restored under a smaller
        rollout.sampling.max_new_tokens: nothing is left to generate)."""
        for name in ("response_ids", "logprobs", "versions", "old_logprobs", "mask"):
            setattr(self, name, getattr(self, name)[:budget])
        self.finish_reason = "length"


@dataclass
class Group:
    """n samples of one prompt."""
    gid: int        # one per new_group() call: the n-th prompt drawn in the run (Sample.uid)
    record: dict
    prompt_ids: list[int]
    slots: list[Slot]
    reward_done: bool = False
    rewards: list[float] = field(default_factory=list)    # one per slot, set when complete
    deadline: Optional[int] = None   # stale_policy=finish: the step that must train it at the latest

    @property
    def done_count(self) -> int:
        return sum(s.done for s in self.slots)

    @property
    def complete(self) -> bool:
        """Every sample done: the group can be scored."""
        return self.done_count == len(self.slots)


@dataclass
class RoundStats:
    """What one round did; turned into per-step metrics by `metrics()`."""
    started: float = 0.0
    ended: float = 0.0
    inflight_area: float = 0.0           # integral of in-flight count over time
    inflight_min: Optional[int] = None   # lowest in-flight count while the round ran (events + timer)
    busy_area: float = 0.0               # integral of (engines with >= 1 request) over time
    last_t: float = 0.0
    last_inflight: int = 0
    last_busy: int = 0
    timer_samples: int = 0               # occupancy samples taken by the timer (not on events)
    loop_lag_max: float = 0.0            # longest the timer woke late: the event loop was blocked
    requests: int = 0                    # results absorbed
    sent: int = 0                        # requests admitted (a held one counts once, where it was sent)
    reprefill_tokens: int = 0            # continuation tokens sent again (abort mode) + KV recomputed
    spanning_requests: int = 0           # results whose tokens came from more than one version
    spanning_tokens: int = 0             # tokens of those results
    tokens: int = 0
    carried: int = 0
    restarted: int = 0
    dropped_groups: int = 0
    discarded_tokens: int = 0            # generated, then thrown away by restart / drop
    throttled: int = 0                   # fills cut short: no deadline free (stale_policy=finish)
    groups_emitted: int = 0


def group_state(g: Group) -> dict:
    """A group as plain lists and numbers (what a checkpoint keeps)."""
    return {"gid": g.gid, "record": g.record, "prompt_ids": list(g.prompt_ids),
            "rewards": list(g.rewards), "reward_done": g.reward_done, "deadline": g.deadline,
            "slots": [{k: (list(v) if isinstance(v, list) else v) for k, v in vars(s).items()}
                      for s in g.slots]}


def _set_tokens(slot: Slot, base: int, r: GenResult, episode: bool = False) -> None:
    """The slot's first `base` tokens, then what its request produced (a held request's
    partial, or its final result, of which every earlier partial is a prefix). An episode's
    slot also marks the new tokens as the model's (mask 1)."""
    slot.response_ids = slot.response_ids[:base] + list(r.token_ids)
    slot.logprobs = slot.logprobs[:base] + list(r.logprobs)
    slot.versions = slot.versions[:base] + list(r.versions)
    if episode:
        slot.mask = slot.mask[:base] + [1] * len(r.token_ids)


def _score_all(score: Callable[[Sample], float], samples: list[Sample]) -> list[float]:
    return [score(s) for s in samples]


class PartialRolloutController:
    """Drives an `EnginePool` (async). `new_group()` returns (record, prompt_ids) of the next
    prompt; `score(sample)` its reward, run in `scorer` (a concurrent.futures executor) or, when
    None, on the loop (only for scores that cost nothing: tests, the simulator). All methods
    run on the pool's event loop."""

    def __init__(self, pool, *, n: int, concurrency: int, max_new_tokens: int, temperature: float,
                 max_staleness: int, new_group: Callable[[], tuple[dict, list[int]]],
                 score: Callable[[Sample], float], seed: int, stale_policy: str = "finish",
                 budget_of: Optional[Callable[[int, int], int]] = None, ignore_eos: bool = False,
                 clock: Callable[[], float] = time.perf_counter, scorer=None,
                 sample_every_s: Optional[float] = 0.05, episodes=None):
        if stale_policy not in STALE_POLICIES:
            raise ValueError(f"rollout.partial.stale_policy={stale_policy!r}: choose one of "
                             f"{', '.join(STALE_POLICIES)}")
        self.pool, self.n, self.concurrency = pool, n, concurrency
        pool.holders.append(self)      # weight updates hold and release the round
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.max_staleness, self.stale_policy = max_staleness, stale_policy
        self.new_group, self.score, self.seed, self.scorer = new_group, score, seed, scorer
        # multi-turn episodes: an envs.episodes.EpisodeDriver (None: single-turn samples)
        self.episodes = episodes
        self._stepping: set[tuple[int, int]] = set()    # (gid, index) of slots whose environment is answering
        self._env_tasks: set[asyncio.Task] = set()
        # benchmarks force lengths: budget_of(gid, index) tokens per sample, EOS ignored
        self.budget_of, self.ignore_eos = budget_of, ignore_eos
        self.clock = clock             # the round's statistics' time source (virtual in the simulator)
        self.sample_every_s = sample_every_s   # occupancy timer period (None: on events only)
        self.groups: dict[int, Group] = {}        # open groups (incl. complete ones being scored), by gid
        self.completed: list[Group] = []           # complete and scored, not yet handed to the trainer
        self.ready: list[Group] = []               # the last round's result, until the driver takes it
        self.next_gid = 0
        self._inflight: dict[str, Slot] = {}
        self._recomputed_mark = self._recomputed_total = 0
        self._sent_total = self._trained_total = 0   # requests sent / samples handed over, whole run
        self._base: dict[str, int] = {}              # request key -> its slot's tokens when it was sent
        self._busy: set[tuple[int, int]] = set()     # (gid, index) of the slots in flight
        # requests this controller has on each engine, counted when admitted (an engine's own
        # `running` only moves once the request's task starts, after a whole burst is admitted)
        self._load: dict[str, int] = {e.name: 0 for e in pool.engines}
        self._turn = 0
        self._tasks: set[asyncio.Task] = set()       # one per request in flight
        self._scoring: set[asyncio.Task] = set()     # one per group being scored off the loop
        self._target = 0
        self._train_version = 0
        self._ending = False
        self._holding = False
        self._round_done: Optional[asyncio.Event] = None
        self._error: Optional[BaseException] = None
        self.stats = RoundStats()

    # -- admission -------------------------------------------------------------------------
    def _key(self, slot: Slot) -> str:
        return f"g{slot.gid}s{slot.index}a{slot.attempts}"

    def _due(self, g: Group) -> bool:
        """The step this round feeds must train `g` (stale_policy=finish)."""
        return g.deadline is not None and g.deadline <= self._train_version

    def _admission_order(self) -> list[Slot]:
        """Waiting slots, best first: samples of groups due this step, carried samples, then
        samples of the groups closest to completion (older groups first on ties). Admitting one
        changes no other's rank (nothing completes while `_fill` runs), so one sort serves a
        whole fill; at 512 in flight this scan is the controller's main cost (the simulator)."""
        busy, ranked = self._busy, []
        for g in self.groups.values():   # one pass: each group's done count and its waiting slots
            done, waiting = 0, []
            for s in g.slots:
                if s.done:
                    done += 1
                elif (s.gid, s.index) not in busy:
                    waiting.append(s)
            later = not self._due(g)
            ranked += [((later, not s.response_ids, -done, s.gid, s.index), s) for s in waiting]
        ranked.sort(key=lambda item: item[0])
        return [s for _, s in ranked]

    def _open_group(self) -> Optional[Group]:
        deadline = None
        if self.stale_policy == "finish":
            deadline = staleness.new_group_deadline(self._untrained(), self._train_version, self.pool.version,
                                                    self.max_staleness, self._target)
            if deadline is None:
                self.stats.throttled += 1
                return None
        record, prompt = self.new_group()
        gid = self.next_gid
        if not prompt:
            raise ValueError(f"prompt {gid} of the data stream encodes to no tokens (record fields: "
                             f"{', '.join(map(str, record)) or 'none'}): check data.prompt_key / data.messages_key "
                             f"and that the model folder has its tokenizer files")
        self.next_gid += 1
        base = seeds.group_seed(self.seed, gid)
        group = Group(gid, record, list(prompt), [Slot(gid, j, seeds.sample_seed(base, j)) for j in range(self.n)],
                      deadline=deadline)
        self.groups[gid] = group
        return group

    def _least_loaded(self):
        """The engine with the fewest of our requests; ties go round-robin."""
        engines = self.pool.engines
        self._turn += 1
        order = [engines[(self._turn + i) % len(engines)] for i in range(len(engines))]
        return min(order, key=lambda e: self._load.get(e.name, 0))

    def _fill(self) -> None:
        """Admit requests up to the concurrency. Raises what new_group / the request raise (the
        callers hand it to `_fail`)."""
        if not self.pool.engines:   # every engine retired: the request that saw it ends the round
            return
        order: list[Slot] = []
        while not self._ending and not self._holding and len(self._inflight) + len(self._stepping) < self.concurrency:
            if not order:
                order = self._admission_order()
                if not order:
                    if self._open_group() is None:
                        break          # the staleness window is full: wait for due work
                    order = self._admission_order()
                order.reverse()   # pop() from the end = best first
            slot = order.pop()
            engine = self._least_loaded()
            req = self._request(slot)   # may raise: nothing is booked yet
            self._inflight[req.key] = slot
            self._base[req.key] = len(slot.response_ids)
            self.stats.sent += 1
            self.stats.reprefill_tokens += len(slot.response_ids)   # a continuation's tokens are prefilled again
            self._busy.add((slot.gid, slot.index))
            self._load[engine.name] = self._load.get(engine.name, 0) + 1
            self._track(self._tasks, self._serve(req, slot, engine))
        self._sample_occupancy()

    def _request(self, slot: Slot) -> GenRequest:
        slot.attempts += 1
        budget = self._budget(slot) - len(slot.response_ids)
        return GenRequest(self._key(slot), self.groups[slot.gid].prompt_ids + slot.response_ids, budget,
                          self.temperature, ignore_eos=self.ignore_eos,
                          # a function of how far the slot got: a rerun draws the same tokens
                          seed=seeds.request_seed(slot.seed, len(slot.response_ids), slot.restarts))

    @staticmethod
    def _track(tasks: set, coro) -> None:
        task = asyncio.ensure_future(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    # -- serving ---------------------------------------------------------------------------
    async def _serve(self, req: GenRequest, slot: Slot, engine) -> None:
        key = req.key
        try:
            if self.episodes is not None and not self.episodes.live(slot):   # its first turn, or resumed
                req = await self._episode_request(req, slot)
            result = None if req is None else await self.pool.generate(req, engine)
        except BaseException as err:   # an engine failure ends the round with the error
            self._unbook(key, slot, engine)
            self._fail(err)
            if isinstance(err, asyncio.CancelledError):
                raise
            return
        base = self._base.get(key, 0)
        self._unbook(key, slot, engine)
        try:
            group = self.groups[slot.gid]   # before any await: a slot finishing meanwhile may emit it
            if result is not None:
                self._absorb(slot, result, base)
                if self.episodes is not None and slot.finish_reason == "stop":
                    await self._env_turn(slot)   # the environment's turn: done, or the next model turn waits
            if slot.done and group.complete and not group.reward_done:
                self._emit(group)
            if self._ending or self._holding:
                self._sample_occupancy()
            else:
                self._fill()   # samples occupancy once refilled: a finished request is replaced at once
        except Exception as err:   # noqa: BLE001 - scoring, the data stream, the next request: end the round
            self._fail(err)

    async def _episode_request(self, req: GenRequest, slot: Slot) -> Optional[GenRequest]:
        """An episode's request once its environment is live: None if the episode ended
        (reset failed); rebuilt if reset appended a first observation."""
        before = len(slot.response_ids)
        task = asyncio.ensure_future(self.episodes.ensure(slot, self.groups[slot.gid]))
        self._env_tasks.add(task)   # a round's end and a snapshot wait for it (_settle_env)
        try:
            await task
        finally:
            self._env_tasks.discard(task)
        if slot.done:
            return None
        if len(slot.response_ids) == before:
            return req
        self._base[req.key] = len(slot.response_ids)
        return dataclasses.replace(req, prompt_ids=self.groups[slot.gid].prompt_ids + slot.response_ids,
                                   max_tokens=self._budget(slot) - len(slot.response_ids))

    async def _env_turn(self, slot: Slot) -> None:
        """A model turn ended on EOS: the slot counts against the concurrency and stays busy
        while its environment answers (off this loop), then it is done or waits for its next
        model turn (admitted like any carried sample)."""
        slot.finish_reason = ""
        where = (slot.gid, slot.index)
        self._busy.add(where)
        self._stepping.add(where)
        task = asyncio.ensure_future(self.episodes.after_turn(slot, self.groups[slot.gid], self._budget(slot)))
        self._env_tasks.add(task)
        try:
            await task
        finally:
            self._env_tasks.discard(task)
            self._stepping.discard(where)
            self._busy.discard(where)

    async def _settle_env(self) -> None:
        """Wait for the environments answering now (each bounded by env.timeout_s), and for
        their slots to be released (the serving task's next step, after the answer)."""
        while self._env_tasks or self._stepping:
            if self._env_tasks:
                await asyncio.gather(*list(self._env_tasks), return_exceptions=True)
            await asyncio.sleep(0)

    def _unbook(self, key: str, slot: Slot, engine) -> None:
        self._load[engine.name] = self._load.get(engine.name, 1) - 1
        self._inflight.pop(key, None)
        self._base.pop(key, None)
        self._busy.discard((slot.gid, slot.index))

    def _fail(self, err: BaseException) -> None:
        """End the round now with `err`: no more admission; run_round aborts and raises it."""
        if self._error is None:
            self._error = err if isinstance(err, Exception) else EngineError(f"rollout interrupted: {err!r}")
        self._ending = True
        if self._round_done is not None:
            self._round_done.set()

    def _budget(self, slot: Slot) -> int:
        return self.budget_of(slot.gid, slot.index) if self.budget_of else self.max_new_tokens

    def _absorb(self, slot: Slot, r: GenResult, base: int) -> None:
        """The request's result after the `base` tokens its slot had when it was sent (what a
        held request's slot got from `_sync_live` since is a prefix of it)."""
        faults.point("rollout_result")
        _set_tokens(slot, base, r, self.episodes is not None)
        self.stats.requests += 1
        self.stats.tokens += len(r.token_ids)
        if len(set(r.versions)) > 1:   # held over a weight update (update_mode=keep)
            self.stats.spanning_requests += 1
            self.stats.spanning_tokens += len(r.token_ids)
        if r.finish_reason in ("stop", "length"):
            slot.finish_reason = r.finish_reason
        elif len(slot.response_ids) >= self._budget(slot):
            slot.finish_reason = "length"   # aborted exactly at the budget: nothing left to do

    def _emit(self, group: Group) -> None:
        """Score a complete group and queue it: at once on the loop, or in `scorer` (the loop
        goes on serving meanwhile; a verifier may take seconds)."""
        group.reward_done = True   # never scored twice
        samples = self.samples_of(group)
        if self.scorer is None:
            self._queue(group, _score_all(self.score, samples))
        else:
            self._track(self._scoring, self._score_off_loop(group, samples))

    async def _score_off_loop(self, group: Group, samples: list[Sample]) -> None:
        try:
            rewards = await asyncio.get_running_loop().run_in_executor(self.scorer, _score_all, self.score, samples)
        except BaseException as err:   # noqa: BLE001 - e.g. the verifier's worker cannot start
            self._fail(err)
            return
        self._queue(group, rewards)

    def _queue(self, group: Group, rewards: list[float]) -> None:
        group.rewards = list(rewards)
        del self.groups[group.gid]
        self.completed.append(group)
        self.stats.groups_emitted += 1
        self._maybe_end()

    def _maybe_end(self) -> None:
        """End the round as soon as it has its groups: stop admitting now, not when run_round
        next runs (requests finishing in the meantime must not start new ones)."""
        if self._round_done is None or len(self.completed) < self._target:
            return
        if any(self._due(g) for g in self.groups.values()):
            return   # a group due this step is still generating (or being scored): it finishes first
        self._ending = True
        self._round_done.set()

    def _sample_occupancy(self) -> None:
        """Integrate in-flight count and busy engines over time (for the round's metrics)."""
        now = self.clock()
        st = self.stats
        if st.last_t:
            dt = now - st.last_t
            st.inflight_area += dt * st.last_inflight
            st.busy_area += dt * st.last_busy
        st.last_t = now
        st.last_inflight = len(self._inflight)
        st.last_busy = sum(1 for n in self._load.values() if n > 0)
        if not self._ending and not self._holding and st.started:
            now_inflight = len(self._inflight)
            st.inflight_min = now_inflight if st.inflight_min is None else min(st.inflight_min, now_inflight)

    async def _occupancy_timer(self) -> None:
        """Sample occupancy every `sample_every_s`, not only on events: a blocked loop (or a
        round starved of work) shows in `rollout_inflight_min` and `rollout_loop_lag_max_s`."""
        period = self.sample_every_s
        while True:
            t0 = self.clock()
            await asyncio.sleep(period)
            self.stats.loop_lag_max = max(self.stats.loop_lag_max, self.clock() - t0 - period)
            self.stats.timer_samples += 1
            self._sample_occupancy()

    # -- rounds ----------------------------------------------------------------------------
    def _untrained(self) -> Iterable[Group]:
        return [*self.groups.values(), *self.completed]

    def _prepare_round(self, version: int) -> None:
        """Before a round for step `version`: the staleness rule on everything untrained, and
        carried samples already at their token budget done (a carry restored under a
        smaller rollout.sampling.max_new_tokens)."""
        for g in self.groups.values():
            for s in g.slots:
                if not s.done and (s.gid, s.index) not in self._busy and len(s.response_ids) >= self._budget(s):
                    s.clip(self._budget(s))
        if self.stale_policy == "finish":
            self.completed, lost = staleness.check_deadlines(self.groups, self.completed, version, self.pool.version,
                                                             self.max_staleness, max(1, self._target))
        else:
            self.completed, lost = staleness.discard_stale(self.groups, self.completed, version, self.max_staleness,
                                                           drop=self.stale_policy == "drop")
        if self.episodes is not None:
            self.episodes.prune(self.groups)
        self.stats.restarted += lost.restarted
        self.stats.dropped_groups += lost.dropped
        self.stats.discarded_tokens += lost.tokens

    @property
    def keeps(self) -> bool:
        """rollout.update_mode=keep: requests live through weight updates and round ends."""
        return getattr(self.pool, "update_mode", "abort") == "keep"

    def _sync_live(self) -> None:
        """Copy what each request in flight has produced so far into its slot (keep mode): the
        trainer's l_old, a checkpoint and the staleness rules see every token generated."""
        for key, slot in self._inflight.items():
            now = self.pool.partial(key)
            if now is not None:
                _set_tokens(slot, self._base.get(key, 0), now, self.episodes is not None)

    async def hold(self, scoring: bool = False) -> None:
        """Stop admitting, so the engines can take new weights in the middle of a round (async
        mode); `release()` continues the round. The pool calls both around every weight update.
        abort mode: also abort what this controller has in flight (tokens stay in their slots);
        keep mode: it stays, held by the pause the update makes.
        `scoring`: also wait for the groups being scored (a snapshot needs them settled)."""
        self._holding = True
        if not self.keeps:
            await self._abort_own()
        await self._settle_env()
        if scoring and self._scoring:
            await asyncio.gather(*list(self._scoring), return_exceptions=True)
        self._sample_occupancy()

    def release(self) -> None:
        self._holding = False
        if self._round_done is not None and not self._round_done.is_set():
            try:
                self._fill()
            except Exception as err:   # noqa: BLE001 - the round ends with it
                self._fail(err)

    async def _abort_own(self) -> None:
        """Abort this controller's requests only (a probe or another scheduler sharing the
        engines keeps running) and wait until every one has resolved."""
        if self._inflight:
            await self.pool.abort(list(self._inflight))
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def run_round(self, target: int, train_version: int) -> list[Group]:
        """Generate until `target` groups are complete (counting ones completed earlier but not
        yet trained) and every group due at `train_version` is complete; abort the rest into the
        carry. Returns exactly `target` groups (due ones, then the oldest), also kept
        in `ready` until `take_ready()`. `train_version`: the weight version of the step that
        will train them (the staleness bound is measured against it)."""
        if self.stale_policy == "finish" and self.pool.engines and \
                self.pool.version + self.max_staleness < train_version:
            raise ValueError(f"rollout.partial.max_staleness={self.max_staleness}: step {train_version} cannot train "
                             f"tokens of weight version {self.pool.version}; rollout.partial.async needs "
                             f"max_staleness >= 1")
        self.ready = []              # a result nobody took was consumed through the return value
        if self.keeps:               # still ending the last round: nothing is admitted meanwhile
            await self._before_keep_round(train_version)
        self.stats = RoundStats()
        self.stats.started = self.clock()
        self._target, self._train_version = target, train_version
        self._ending, self._error = False, None
        self._round_done = asyncio.Event()
        timer = None
        if self.sample_every_s:
            timer = asyncio.ensure_future(self._occupancy_timer())
        try:
            self._prepare_round(train_version)
            for g in [g for g in self.groups.values() if g.complete and not g.reward_done]:
                self._emit(g)        # restored or clipped complete groups
            self._maybe_end()
            if not self._round_done.is_set():
                self._fill()
        except Exception as err:   # noqa: BLE001 - same path as an error in the serve loop
            self._fail(err)
        try:
            await self._round_done.wait()
        finally:
            self._ending = True
            self._sample_occupancy()
            self.stats.carried = len(self._inflight)
            await self._carry_inflight()
            if self._scoring:
                await asyncio.gather(*list(self._scoring), return_exceptions=True)
            if timer is not None:
                timer.cancel()
            self.stats.ended = self.clock()
            self._round_done = None
        if self._error is not None:
            raise self._error
        self.completed.sort(key=lambda g: staleness.training_order(g, train_version))
        self.ready, self.completed = self.completed[:target], self.completed[target:]
        self._sent_total += self.stats.sent
        self._trained_total += sum(len(g.slots) for g in self.ready)
        return self.ready

    async def _carry_inflight(self) -> None:
        """The round's end: keep mode pauses the engines with this controller's requests held
        and copies their tokens so far into their slots (the pause holds every request on the
        engines: one scheduler per pool); abort mode aborts them (they resolve into their slots)."""
        if self.keeps and self._inflight and self._error is None:
            try:
                await self.pool.pause_all()
                self._sync_live()
                await self._settle_env()   # an episode between turns is carried as such
                return
            except Exception as err:   # noqa: BLE001 - an engine failed pausing: abort as below
                self._fail(err)
        await self._abort_own()   # in-flight requests resolve with their partials

    async def _before_keep_round(self, version: int) -> None:
        """Keep mode, before a round: the engines resume the requests held since the last round
        (unless a weight update holds them now; its end resumes them), and a held request whose
        slot the staleness rule will restart or drop is aborted first (it cannot be rewound)."""
        if not self.pool.updating:
            await self.pool.resume_all()
        self._sync_live()
        stale = [k for k, s in self._inflight.items()
                 if staleness.stale_slots(self.groups[s.gid], version, self.max_staleness)]
        if stale:
            await self.pool.abort(stale)
            # abort() returns once the engines resolved them; their _serve continuations (which
            # put the tokens into the slots and unbook them) run in the next loop iterations
            for _ in range(1000):
                if not any(k in self._inflight for k in stale):
                    break
                await asyncio.sleep(0)

    def take_ready(self) -> list[Group]:
        """The driver takes the last round's groups: from now on they are the trainer's."""
        out, self.ready = self.ready, []
        return out

    # -- views -----------------------------------------------------------------------------
    def samples_of(self, group: Group, local_index: int = 0) -> list[Sample]:
        out = []
        for s in group.slots:
            smp = Sample(group.prompt_ids, list(s.response_ids), list(s.logprobs), list(s.versions),
                         s.finish_reason == "stop", local_index, group.record, reward=s.env_reward,
                         finish_reason=s.finish_reason or "abort", old_logprobs=list(s.old_logprobs),
                         uid=group.gid, mask=list(s.mask), turns=s.turns)
            out.append(smp)
        for smp, r in zip(out, group.rewards):
            smp.reward = r
        return out

    def pending_old_logprobs(self) -> list[tuple[Slot, int, int, Sample]]:
        """Slots of groups not handed to the trainer (open, or complete but waiting) holding
        tokens whose trainer logprob is not stored yet (those generated this round): the
        trainer computes them before its weights change."""
        out = []
        for g in [*self.groups.values(), *self.completed]:
            for s in g.slots:
                if len(s.old_logprobs) < len(s.response_ids):
                    out.append((s, s.restarts, len(s.response_ids),
                                Sample(g.prompt_ids, list(s.response_ids), list(s.logprobs),
                                       list(s.versions), False, 0, g.record)))
        return out

    @staticmethod
    def store_old_logprobs(slot: Slot, restarts: int, length: int, values: list[float]) -> None:
        """Keep the stored prefix; append the newly computed suffix (stitching). `restarts`
        and `length` describe the snapshot the values were computed for: a slot restarted
        since is left alone, and tokens generated since stay without a stored value."""
        if slot.restarts != restarts or len(slot.response_ids) < length:
            return
        slot.old_logprobs = slot.old_logprobs + list(values[len(slot.old_logprobs):length])

    def metrics(self) -> dict:
        st = self.stats
        wall = max(st.ended - st.started, 1e-9)
        open_tokens = [s for g in self.groups.values() for s in g.slots if s.response_ids and not s.done]
        out = {"rollout_inflight_mean": st.inflight_area / wall, "rollout_concurrency": self.concurrency,
               "engine_busy_frac": st.busy_area / wall / max(1, len(self.pool.engines)),
               "rollout_requests": st.requests, "rollout_tokens": st.tokens,
               "rollout_requests_sent": st.sent, "reprefill_tokens": st.reprefill_tokens + self._recomputed(),
               "requests_per_trained_sample": self._sent_total / max(1, self._trained_total),
               "requests_spanning_versions": st.spanning_requests, "tokens_of_spanning_requests": st.spanning_tokens,
               "carried_samples": len(open_tokens), "aborted_inflight": st.carried,
               "restarted_samples": st.restarted, "dropped_groups": st.dropped_groups,
               "stale_tokens_discarded": st.discarded_tokens, "admission_throttled": st.throttled,
               "rollout_loop_lag_max_s": st.loop_lag_max,
               "groups_emitted": st.groups_emitted, "open_groups": len(self.groups),
               "completed_waiting": len(self.completed)}
        if self.episodes is not None:
            out.update(self._episode_metrics())
        if st.inflight_min is not None:   # absent when the round had its groups without generating
            out["rollout_inflight_min"] = st.inflight_min
        return out

    def _episode_metrics(self) -> dict:
        """Episodes carried into the next round: between turns (the environment answered, the
        next model turn not started) and mid-turn (a model turn begun); the environments' counts."""
        open_slots = [s for g in self.groups.values() for s in g.slots if not s.done and s.response_ids]
        mid_turn = sum(len(s.response_ids) > s.turn_base for s in open_slots)
        return {"episodes_carried_mid_turn": mid_turn,
                "episodes_carried_between_turns": len(open_slots) - mid_turn,
                **self.episodes.take_metrics()}

    def kv_dropped(self) -> None:
        """The pool's weight update is dropping the held requests' KV (keep mode,
        rollout.keep_kv=false): their response tokens so far are computed again, as a
        continuation's are in abort mode (counted alike: tokens beyond the group's prompt)."""
        self._sync_live()
        self._recomputed_total += sum(len(s.response_ids) for s in self._inflight.values())

    def _recomputed(self) -> int:
        """Response tokens whose KV the weight updates since the last call dropped."""
        out, self._recomputed_mark = self._recomputed_total - self._recomputed_mark, self._recomputed_total
        return out

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain lists and numbers: the carry, open and completed groups (the untaken result of
        the last round first: the resumed run's first round takes them), the group counter.
        Keep mode: a request in flight is saved as its tokens so far (a resumed run sends it
        again as a continuation); a group still being scored is saved unscored (scored again)."""
        # keep mode: held requests run on (a checkpoint after the push), so a group may complete
        # and start scoring after hold() waited for the scoring: it is saved unscored, below
        if self._stepping or (not self.keeps and (self._inflight or self._scoring)):
            raise RuntimeError("controller state saved while requests are in flight or groups are "
                               "being scored: hold(scoring=True) first, or save between rounds")
        self._sync_live()
        open_groups = [{**group_state(g), "reward_done": False, "rewards": []} for g in self.groups.values()]
        return {"next_gid": self.next_gid, "open": open_groups,
                "completed": [group_state(g) for g in [*self.ready, *self.completed]]}

    def load_state_dict(self, state: dict) -> None:
        def group_of(d: dict) -> Group:
            return Group(d["gid"], d["record"], list(d["prompt_ids"]), [Slot(**s) for s in d["slots"]],
                         d["reward_done"], list(d["rewards"]), d.get("deadline"))
        self.next_gid = state["next_gid"]
        self.groups = {d["gid"]: group_of(d) for d in state["open"]}
        self.completed = [group_of(d) for d in state["completed"]]
        self.ready = []
