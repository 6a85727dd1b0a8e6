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
  the loop when a `scorer` is given) and queued for the trainer.
- the round ends when `train.groups_per_step` groups are complete AND every group due this
  step (below) is complete; the step takes every complete group it may, in whole multiples of
  groups_per_step up to `step_multiple` times it (elastic steps). What is still in flight is
  carried (rollout.update_mode): keep (default) pauses the engines with the requests held,
  copies their tokens so far into their slots (`pool.partial`) and resumes the same requests
  under the new version; abort aborts them and sends each again as a continuation (prompt +
  tokens so far) in a later round. The round's groups stay in `ready` until the driver takes
  them (`take_ready`): a snapshot taken at any moment holds every untrained group once.
- any exception (engine, scoring, the data stream, building a request) ends the round at once
  and is raised by `run_round`.

Staleness (`rollout.partial.stale_policy`, megarl/rollout/controller/staleness.py): by default (`finish`) every
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

Its parts: `slots.py` (the groups and slots, their plain-data form), `round_stats.py` (the
round's counts and metrics), `admission.py` (which sample is sent next, to which engine),
`serving.py` (a request's result into its slot, complete groups scored and queued),
`carry.py` (holding and carrying requests at a round's end and around weight updates),
`episode_turns.py` (environment turns of multi-turn episodes); this module holds the
controller's state, runs and ends rounds, and gives its views and checkpoint form.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable, Iterable, Optional

from megarl.data.sample import Sample
from megarl.rollout.controller import staleness
from megarl.rollout.controller.admission import Admission
from megarl.rollout.controller.carry import CarryOver
from megarl.rollout.controller.episode_turns import EpisodeTurns
from megarl.rollout.controller.group_filter import GroupFilter
from megarl.rollout.controller.round_stats import RoundStats, round_metrics
from megarl.rollout.controller.serving import Serving
from megarl.rollout.controller.slots import (
    Group,
    Slot,
    group_from_state,
    group_samples,
    group_state,
    sample_routes,
)
from megarl.rollout.controller.slots import store_old_logprobs as _store_old_logprobs
from megarl.rollout.controller.sync_rollout import REFUSED, all_refused
from megarl.rollout.engines.engine import EngineError, RequestError

STALE_POLICIES = staleness.POLICIES


class PartialRolloutController(Admission, Serving, CarryOver, EpisodeTurns):
    """Drives an `EnginePool` (async). `new_group()` returns (record, prompt_ids) of the next
    prompt; `score(sample)` its reward, run in `scorer` (a concurrent.futures executor) or, when
    None, on the loop (only for scores that cost nothing: tests, the simulator); `scorer` may
    instead be a coroutine function, samples -> rewards, that the loop awaits while it scores
    elsewhere (the run's reward runner; `score` is then unused). All methods
    run on the pool's event loop (`loop`, or the loop of the first call): its state changes
    there (requests finish, groups are scored, held requests run on between rounds), so a
    public method called from another thread while that loop runs raises (`_on_loop`)."""

    def __init__(self, pool, *, n: int, concurrency: int, max_new_tokens: int, temperature: float,
                 max_staleness: int, new_group: Callable[[], tuple[dict, list[int]]],
                 score: Optional[Callable[[Sample], float]], seed: int, stale_policy: str = "finish",
                 budget_of: Optional[Callable[[int, int], int]] = None, ignore_eos: bool = False,
                 clock: Callable[[], float] = time.perf_counter, scorer=None,
                 sample_every_s: Optional[float] = 0.05, episodes=None,
                 loop: Optional[asyncio.AbstractEventLoop] = None, step_multiple: int = 1,
                 group_filter: Optional[GroupFilter] = None, top_p: float = 1.0, top_k: int = -1):
        if stale_policy not in STALE_POLICIES:
            raise ValueError(f"rollout.partial.stale_policy={stale_policy!r}: choose one of "
                             f"{', '.join(STALE_POLICIES)}")
        self.pool, self.n, self.concurrency = pool, n, concurrency
        self._loop = loop              # the event loop this controller lives on (see _on_loop)
        pool.holders.append(self)      # weight updates hold and release the round
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.top_p, self.top_k = top_p, top_k     # rollout.sampling's cut, on every request
        self.max_staleness, self.stale_policy = max_staleness, stale_policy
        # elastic steps: a step trains up to step_multiple x its target groups (whole multiples
        # of the target; rollout.partial.max_step_multiple); 1: exactly the target
        if step_multiple < 1:   # a clamp would hide the mistake: refused like the schema refuses it
            raise ValueError(f"rollout.partial.max_step_multiple={step_multiple}: must be >= 1 "
                             f"(1: every step trains exactly train.groups_per_step groups)")
        self.step_multiple = step_multiple
        # rollout.group_filter: judges each scored group (serving._queue); default: keep every one
        self.group_filter = group_filter or GroupFilter()
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
        self._gen: dict[str, int] = {}               # request key -> its slot's restarts when it was sent
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
        self._wanted: Optional[asyncio.Event] = None   # async mode: the step asked for the round
        self._error: Optional[BaseException] = None
        self._refusal: Optional[RequestError] = None   # the round's first refused request
        self._refused_total = 0
        self.stats = RoundStats()

    def _on_loop(self, what: str) -> None:
        """Keep the loop-thread-only promise: `what` (a public method) is called on the
        controller's event loop, or while that loop is not running (before it starts, after it
        stopped: nothing else can touch the state then). The first call from a running loop
        binds the controller to it when no `loop` was given."""
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if self._loop is None:
            self._loop = here
        elif here is not self._loop and self._loop.is_running():
            raise RuntimeError(f"PartialRolloutController.{what}() called from thread "
                               f"{threading.current_thread().name!r}: the controller is used on its event "
                               f"loop's thread only (its state changes there): run the call on that loop "
                               f"(SyncPool.call, asyncio.run_coroutine_threadsafe)")

    @staticmethod
    def _track(tasks: set, coro) -> None:
        task = asyncio.ensure_future(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def _fail(self, err: BaseException) -> None:
        """End the round now with `err`: no more admission; run_round aborts and raises it.
        Between rounds (keep mode: held requests run on after the push) the next round raises it."""
        if self._error is None:
            self._error = err if isinstance(err, Exception) else EngineError(f"rollout interrupted: {err!r}")
        self._ending = True
        if self._round_done is not None:
            self._round_done.set()

    def _budget(self, slot: Slot) -> int:
        return self.budget_of(slot.gid, slot.index) if self.budget_of else self.max_new_tokens

    # -- the round's end -------------------------------------------------------------------
    def _maybe_end(self) -> None:
        """End the round as soon as it has its groups: stop admitting now, not when run_round
        next runs (requests finishing in the meantime must not start new ones)."""
        if self._round_done is None or len(self.completed) < self._target:
            return
        if self._wanted is not None and not self._wanted.is_set():
            return   # async mode: the step before still trains; the engines go on meanwhile
        due_open = [g for g in self.groups.values() if self._due(g)]
        if due_open:
            # the round has its groups but a due one still generates (or is being scored):
            # it finishes first; the wait and the samples it waits for are counted. (Called per
            # emitted group: the complete ones are counted only once no due group is open.)
            if self.stats.due_wait_from is None:
                self.stats.due_wait_from = self.clock()
                self.stats.due_wait_samples = sum(1 for g in due_open for s in g.slots if not s.done)
            return
        due_complete = sum(1 for g in self.completed if self._due(g))
        if not staleness.round_may_end(len(self.completed), due_complete, len(due_open), self._target):
            return
        self._ending = True
        self._round_done.set()

    def _sample_occupancy(self) -> None:
        """Integrate in-flight count and busy engines over time (for the round's metrics)."""
        self.stats.occupancy(self.clock(), len(self._inflight), sum(1 for n in self._load.values() if n > 0),
                             counting=not self._ending and not self._holding)

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
    @property
    def step_cap(self) -> int:
        """The most groups the current round's step trains (also the deadline room per step)."""
        return self._target * self.step_multiple

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
                                                             self.max_staleness, max(1, self.step_cap))
        else:
            self.completed, lost = staleness.discard_stale(self.groups, self.completed, version, self.max_staleness,
                                                           drop=self.stale_policy == "drop")
        if self.episodes is not None:
            self.episodes.prune(self.groups)
        self.stats.restarted += lost.restarted
        self.stats.dropped_groups += lost.dropped
        self.stats.discarded_tokens += lost.tokens

    async def run_round(self, target: int, train_version: int,
                        wanted: Optional[asyncio.Event] = None) -> list[Group]:
        """Generate until `target` groups are complete (counting ones completed earlier but not
        yet trained) and every group due at `train_version` is complete; abort the rest into the
        carry. Returns the step's groups (due ones, then the oldest): `target` of them, or with
        elastic steps (`step_multiple` > 1) every complete one up to `step_cap`, in whole
        multiples of `target` (staleness.step_groups); also kept in `ready` until `take_ready()`.
        `train_version`: the weight version of the step that will train them (the staleness
        bound is measured against it). `wanted` (async mode: a round started before its step
        may take it): the round ends no sooner than this event is set, so the engines keep
        generating while the trainer trains the step before."""
        self._on_loop("run_round")
        if self.stale_policy == "finish" and self.pool.engines and \
                self.pool.version + self.max_staleness < train_version:
            raise ValueError(f"rollout.partial.max_staleness={self.max_staleness}: step {train_version} cannot train "
                             f"tokens of weight version {self.pool.version}; rollout.partial.async needs "
                             f"max_staleness >= 1")
        self.ready = []              # a result nobody took was consumed through the return value
        self._raise_error()          # a failure between rounds (keep mode) is this round's
        if self.keeps:               # still ending the last round: nothing is admitted meanwhile
            await self._before_keep_round(train_version)
        self.stats = RoundStats()
        self.stats.started = self.clock()
        self._target, self._train_version, self._wanted = target, train_version, wanted
        self._ending, self._refusal = False, None
        self._round_done = asyncio.Event()
        helpers = []
        if self.sample_every_s:
            helpers.append(asyncio.ensure_future(self._occupancy_timer()))
        if wanted is not None and not wanted.is_set():
            helpers.append(asyncio.ensure_future(self._end_when_wanted(wanted)))
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
            await self._end_round(helpers)
        self._raise_error()
        return self._take_step(target, train_version)

    async def _end_when_wanted(self, wanted: asyncio.Event) -> None:
        await wanted.wait()
        self._maybe_end()

    async def _end_round(self, helpers: list) -> None:
        """Stop admitting, carry what is in flight, wait for the scorings, close the stats."""
        self._ending = True
        self._sample_occupancy()
        self.stats.carried = len(self._inflight)
        await self._carry_inflight()
        if self._scoring:
            await asyncio.gather(*list(self._scoring), return_exceptions=True)
        for task in helpers:
            task.cancel()
        self.stats.ended = self.clock()
        self._round_done = self._wanted = None

    def _take_step(self, target: int, train_version: int) -> list[Group]:
        """The step's groups out of the complete ones (due first, then the oldest)."""
        self.completed.sort(key=lambda g: staleness.training_order(g, train_version))
        take = staleness.step_groups(len(self.completed), sum(1 for g in self.completed if self._due(g)),
                                     target, self.step_cap)
        self.ready, self.completed = self.completed[:take], self.completed[take:]
        self.stats.groups_trained = len(self.ready)
        refused = [s for g in self.ready for s in g.slots if s.finish_reason == REFUSED]
        if self.ready and len(refused) == sum(len(g.slots) for g in self.ready):
            raise all_refused(len(refused), self._refusal)
        self._sent_total += self.stats.sent
        self._trained_total += sum(len(g.slots) for g in self.ready)
        return self.ready

    def _raise_error(self) -> None:
        """Raise (once) the error that ended the round, or that a request or a scoring raised
        since the last round ended."""
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def take_ready(self) -> list[Group]:
        """The driver takes the last round's groups: from now on they are the trainer's."""
        self._on_loop("take_ready")
        out, self.ready = self.ready, []
        return out

    # -- views -----------------------------------------------------------------------------
    @staticmethod
    def samples_of(group: Group, local_index: int = 0) -> list[Sample]:
        """The group's samples (copies; `slots.group_samples`)."""
        return group_samples(group, local_index)

    def pending_old_logprobs(self) -> list[tuple[Slot, int, int, Sample]]:
        """Slots of groups not handed to the trainer (open, or complete but waiting) holding
        tokens whose trainer logprob is not stored yet (those generated this round): the
        trainer computes them before its weights change."""
        self._on_loop("pending_old_logprobs")
        out = []
        for g in [*self.groups.values(), *self.completed]:
            for s in g.slots:
                if len(s.old_logprobs) < len(s.response_ids):
                    # the episode's loss mask: routing replay needs routes only up to its last
                    # model token (an observation not yet fed to an engine has none)
                    out.append((s, s.restarts, len(s.response_ids),
                                Sample(g.prompt_ids, list(s.response_ids), list(s.logprobs),
                                       list(s.versions), False, 0, g.record, mask=list(s.mask), turns=s.turns,
                                       routes=sample_routes(g, s))))
        return out

    def store_old_logprobs(self, slot: Slot, restarts: int, length: int, values: list[float]) -> None:
        """The trainer's values of a slot `pending_old_logprobs` listed (`slots.store_old_logprobs`)."""
        self._on_loop("store_old_logprobs")
        _store_old_logprobs(slot, restarts, length, values)

    def metrics(self) -> dict:
        """The last round's metrics, with the carry and the groups waiting now."""
        self._on_loop("metrics")
        open_tokens = [s for g in self.groups.values() for s in g.slots if s.response_ids and not s.done]
        out = round_metrics(self.stats, concurrency=self.concurrency, engines=len(self.pool.engines),
                            reprefill_extra=self._recomputed(),
                            requests_per_trained_sample=self._sent_total / max(1, self._trained_total))
        out.update({"carried_samples": len(open_tokens), "open_groups": len(self.groups),
                    "completed_waiting": len(self.completed),
                    "groups_filtered_total": self.group_filter.filtered_total})
        if self.episodes is not None:
            out.update(self._episode_metrics())
        return out

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain lists and numbers: the carry, open and completed groups (the untaken result of
        the last round first: the resumed run's first round takes them), the group counter.
        Keep mode: a request in flight is saved as its tokens so far (a resumed run sends it
        again as a continuation); a group still being scored is saved unscored (scored again)."""
        self._on_loop("state_dict")
        # keep mode: held requests run on (a checkpoint after the push), so a group may complete
        # and start scoring after hold() waited for the scoring: it is saved unscored, below
        if self._stepping or (not self.keeps and (self._inflight or self._scoring)):
            raise RuntimeError("controller state saved while requests are in flight or groups are "
                               "being scored: hold(scoring=True) first, or save between rounds")
        self._sync_live()
        open_groups = [{**group_state(g), "reward_done": False, "rewards": []} for g in self.groups.values()]
        return {"next_gid": self.next_gid, "open": open_groups,
                "completed": [group_state(g) for g in [*self.ready, *self.completed]],
                "filter": self.group_filter.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._on_loop("load_state_dict")
        self.next_gid = state["next_gid"]
        self.groups = {d["gid"]: group_from_state(d) for d in state["open"]}
        self.completed = [group_from_state(d) for d in state["completed"]]
        self.ready = []
        self.group_filter.load_state_dict(state.get("filter"))   # absent: a checkpoint from before filters
