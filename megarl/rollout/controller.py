"""The partial-rollout controller: fixed concurrency, group emission, carry-over, bounded staleness.

One round (DESIGN.md "One training step"), on the pool's event loop (trainer rank 0):
- exactly `rollout.concurrency` sample requests stay in flight across the engines while the
  round runs; a finished request is replaced at once (the pool sends it to the least-loaded
  engine). New prompt groups are always available, so "work pending" never runs dry.
- admission is frontier-first: carried samples (tokens already generated) first, then waiting
  samples of the groups closest to completion, then a new group (n samples of one prompt).
- a group whose n samples have all finished is scored at once and queued for the trainer.
- when `train.groups_per_step` groups are complete the round ends: every in-flight request
  is aborted, and its tokens, behaviour logprobs and versions so far stay in its slot (the
  carry). Next round it continues as prompt + partial tokens with the remaining budget.
- at the start of a round, a sample whose oldest token is more than `rollout.max_staleness`
  versions old is restarted from its prompt (or, with `rollout.stale_policy=drop`, its whole
  group is dropped), so every token the trainer sees is at most that many versions old.

Stitched old logprobs (CoPRIS): `Slot.old_logprobs` holds the trainer's logprob of each token
under the version that produced it. At the end of every round the trainer computes them for
the tokens generated in that round (of carried and finished samples alike) before its weights
change; `PPO` then uses the stored values instead of recomputing them under newer weights.

Everything here is plain data: `state_dict()` holds the open groups with every slot's tokens,
logprobs, versions and stored old logprobs, the completed-but-untrained groups and the group
counter, as lists and numbers, so a checkpoint restores the carry exactly.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from megarl.distributed import faults
from megarl.rollout.engine import EngineError, GenRequest, GenResult
from megarl.rollout.types import Sample


@dataclass
class Slot:
    """One sample of a group: what has been generated for it so far."""
    gid: int
    index: int
    seed: int
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)    # behaviour (engine) logprobs
    versions: list[int] = field(default_factory=list)      # version that produced each token
    old_logprobs: list[float] = field(default_factory=list)  # trainer l_old, stitched (a prefix)
    finish_reason: str = ""                                 # "" until stop | length
    restarts: int = 0
    attempts: int = 0                                       # requests sent (unique request keys)

    @property
    def finished(self) -> bool:
        return self.finish_reason in ("stop", "length")

    def restart(self) -> None:
        """Forget everything generated (the staleness bound was exceeded)."""
        self.response_ids, self.logprobs, self.versions, self.old_logprobs = [], [], [], []
        self.finish_reason = ""
        self.restarts += 1


@dataclass
class Group:
    """n samples of one prompt."""
    gid: int        # one per new_group() call: the n-th prompt drawn in the run (Sample.uid)
    record: dict
    prompt_ids: list[int]
    slots: list[Slot]
    reward_done: bool = False
    rewards: list[float] = field(default_factory=list)    # one per slot, set when complete

    @property
    def done(self) -> int:
        return sum(s.finished for s in self.slots)

    @property
    def complete(self) -> bool:
        return self.done == len(self.slots)


@dataclass
class RoundStats:
    """What one round did; turned into per-step metrics by `metrics()`."""
    started: float = 0.0
    ended: float = 0.0
    inflight_area: float = 0.0           # integral of in-flight count over time
    inflight_min: Optional[int] = None   # lowest in-flight count while the round ran
    busy_area: float = 0.0               # integral of (engines with >= 1 request) over time
    last_t: float = 0.0
    last_inflight: int = 0
    last_busy: int = 0
    requests: int = 0
    tokens: int = 0
    carried: int = 0
    restarted: int = 0
    dropped_groups: int = 0
    groups_emitted: int = 0


def group_state(g: Group) -> dict:
    """A group as plain lists and numbers (what a checkpoint keeps)."""
    return {"gid": g.gid, "record": g.record, "prompt_ids": list(g.prompt_ids),
            "rewards": list(g.rewards), "reward_done": g.reward_done,
            "slots": [{k: (list(v) if isinstance(v, list) else v) for k, v in vars(s).items()}
                      for s in g.slots]}


def request_seed(slot: Slot) -> int:
    """Sampling seed of the next request of `slot`: a function of its base seed, how many tokens
    it already has and how often it restarted, so reruns draw the same tokens."""
    return (slot.seed * 1_000_003 + len(slot.response_ids) * 7919 + slot.restarts * 104_729) % (2**31 - 1)


class PartialRolloutController:
    """Drives an `EnginePool` (async). `new_group()` returns (record, prompt_ids) of the next
    prompt; `score(sample)` its reward. All methods run on the pool's event loop."""

    def __init__(self, pool, *, n: int, concurrency: int, max_new_tokens: int, temperature: float,
                 max_staleness: int, stale_policy: str, new_group: Callable[[], tuple[dict, list[int]]],
                 score: Callable[[Sample], float], seed: int,
                 budget_of: Optional[Callable[[int, int], int]] = None, ignore_eos: bool = False,
                 clock: Callable[[], float] = time.perf_counter):
        self.pool, self.n, self.concurrency = pool, n, concurrency
        pool.holders.append(self)      # weight updates hold and release the round
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.max_staleness, self.stale_policy = max_staleness, stale_policy
        self.new_group, self.score, self.seed = new_group, score, seed
        # benchmarks force lengths: budget_of(gid, index) tokens per sample, EOS ignored
        self.budget_of, self.ignore_eos = budget_of, ignore_eos
        self.clock = clock             # the round's statistics' time source (virtual in the simulator)
        self.groups: dict[int, Group] = {}        # open (incomplete) groups, by gid
        self.completed: list[Group] = []           # complete, not yet handed to the trainer
        self.next_gid = 0
        self._inflight: dict[str, Slot] = {}
        self._busy: set[tuple[int, int]] = set()     # (gid, index) of the slots in flight
        # requests this controller has on each engine, counted when admitted (an engine's own
        # `running` only moves once the request's task starts, after a whole burst is admitted)
        self._load: dict[str, int] = {e.name: 0 for e in pool.engines}
        self._turn = 0
        self._tasks: set[asyncio.Task] = set()
        self._target = 0
        self._ending = False
        self._holding = False
        self._round_done: Optional[asyncio.Event] = None
        self._error: Optional[BaseException] = None
        self.stats = RoundStats()

    # -- admission -------------------------------------------------------------------------
    def _key(self, slot: Slot) -> str:
        return f"g{slot.gid}s{slot.index}a{slot.attempts}"

    def _admission_order(self) -> list[Slot]:
        """Waiting slots, best first. Frontier-first: carried samples, then samples of the
        groups closest to completion (older groups first on ties). Admitting one changes no
        other's rank (nothing completes while `_fill` runs), so one sort serves a whole fill;
        at 512 in flight this scan is the controller's main cost (found by the simulator)."""
        busy, ranked = self._busy, []
        for g in self.groups.values():   # one pass: each group's done count and its waiting slots
            done, waiting = 0, []
            for s in g.slots:
                if s.finished:
                    done += 1
                elif (s.gid, s.index) not in busy:
                    waiting.append(s)
            ranked += [((not s.response_ids, -done, s.gid, s.index), s) for s in waiting]
        ranked.sort(key=lambda item: item[0])
        return [s for _, s in ranked]

    def _open_group(self) -> Group:
        record, prompt = self.new_group()
        gid = self.next_gid
        self.next_gid += 1
        base = (self.seed * 1_000_003 + gid * 10_007) % (2**31 - 1)
        group = Group(gid, record, list(prompt), [Slot(gid, j, base * 1000 + j) for j in range(self.n)])
        self.groups[gid] = group
        return group

    def _least_loaded(self):
        """The engine with the fewest of our requests; ties go round-robin."""
        engines = self.pool.engines
        self._turn += 1
        order = [engines[(self._turn + i) % len(engines)] for i in range(len(engines))]
        return min(order, key=lambda e: self._load.get(e.name, 0))

    def _fill(self) -> None:
        if not self.pool.engines:   # every engine retired: the request that saw it ends the round
            return
        order: list[Slot] = []
        while not self._ending and not self._holding and len(self._inflight) < self.concurrency:
            if not order:
                order = self._admission_order()
                if not order:
                    self._open_group()
                    order = self._admission_order()
                order.reverse()   # pop() from the end = best first
            slot = order.pop()
            slot.attempts += 1
            key = self._key(slot)
            self._inflight[key] = slot
            self._busy.add((slot.gid, slot.index))
            engine = self._least_loaded()
            self._load[engine.name] += 1
            task = asyncio.ensure_future(self._serve(key, slot, engine))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._sample_occupancy()

    # -- serving ---------------------------------------------------------------------------
    async def _serve(self, key: str, slot: Slot, engine) -> None:
        group = self.groups[slot.gid]
        budget = self._budget(slot) - len(slot.response_ids)
        req = GenRequest(key, group.prompt_ids + slot.response_ids, budget, self.temperature,
                         seed=request_seed(slot), ignore_eos=self.ignore_eos)
        try:
            result = await self.pool.generate(req, engine)
        except BaseException as err:  # an engine failure ends the round with the error
            self._load[engine.name] -= 1
            self._inflight.pop(key, None)
            self._busy.discard((slot.gid, slot.index))
            if self._error is None:
                self._error = err if isinstance(err, Exception) else EngineError(str(err))
            if self._round_done is not None:
                self._round_done.set()
            return
        self._load[engine.name] -= 1
        self._inflight.pop(key, None)
        self._busy.discard((slot.gid, slot.index))
        self._absorb(slot, result)
        if slot.finished and group.complete and not group.reward_done:
            self._emit(group)
        if self._ending or self._holding:
            self._sample_occupancy()
        else:
            self._fill()   # samples occupancy once refilled: a finished request is replaced at once

    def _budget(self, slot: Slot) -> int:
        return self.budget_of(slot.gid, slot.index) if self.budget_of else self.max_new_tokens

    def _absorb(self, slot: Slot, r: GenResult) -> None:
        faults.point("rollout_result")
        slot.response_ids += r.token_ids
        slot.logprobs += r.logprobs
        slot.versions += r.versions
        self.stats.requests += 1
        self.stats.tokens += len(r.token_ids)
        if r.finish_reason in ("stop", "length"):
            slot.finish_reason = r.finish_reason
        elif len(slot.response_ids) >= self._budget(slot):
            slot.finish_reason = "length"   # aborted exactly at the budget: nothing left to do

    def _emit(self, group: Group) -> None:
        group.rewards = [self.score(s) for s in self.samples_of(group)]
        group.reward_done = True
        del self.groups[group.gid]
        self.completed.append(group)
        self.stats.groups_emitted += 1
        if len(self.completed) >= self._target and self._round_done is not None:
            # stop admitting now, not when run_round next runs: requests finishing in the
            # meantime must not start new ones (they would only be aborted)
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
            st.inflight_min = len(self._inflight) if st.inflight_min is None else min(st.inflight_min, len(self._inflight))

    # -- rounds ----------------------------------------------------------------------------
    def apply_staleness(self, version: int) -> None:
        """Before a round under `version`: restart (or drop the group of) every sample holding
        a token more than max_staleness versions old; finished samples of open groups too,
        so the bound holds for everything the trainer will see."""
        waiting, self.completed = self.completed, []
        for group in waiting:                      # complete but untrained: back to open if stale
            self.groups[group.gid] = group
        for gid in sorted(self.groups):
            group = self.groups[gid]
            stale = [s for s in group.slots if s.versions and version - min(s.versions) > self.max_staleness]
            if stale and self.stale_policy == "drop":
                del self.groups[gid]
                self.stats.dropped_groups += 1
                continue
            for s in stale:
                s.restart()
                self.stats.restarted += 1
            if stale:
                group.reward_done, group.rewards = False, []
        for group in waiting:
            if group.gid in self.groups and group.complete:
                del self.groups[group.gid]
                self.completed.append(group)

    async def hold(self) -> None:
        """Stop admitting and abort what is in flight (tokens stay in their slots), so the
        engines can take new weights in the middle of a round (async mode); `release()`
        continues the round. The pool calls both around every weight update."""
        self._holding = True
        await self.pool.abort()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        self._sample_occupancy()

    def release(self) -> None:
        self._holding = False
        if self._round_done is not None and not self._round_done.is_set():
            self._fill()

    async def run_round(self, target: int, train_version: int) -> list[Group]:
        """Generate until `target` groups are complete (counting ones completed earlier but not
        yet trained); abort the rest into the carry. Returns exactly `target` groups.
        `train_version`: the weight version of the step that will train them (the staleness
        bound is measured against it)."""
        self.stats = RoundStats()
        self.stats.started = self.clock()
        self.apply_staleness(train_version)
        self._target, self._ending, self._error = target, False, None
        self._round_done = asyncio.Event()
        if len(self.completed) < target:
            self._fill()
            await self._round_done.wait()
        self._ending = True
        self._sample_occupancy()
        self.stats.carried = len(self._inflight)
        await self.pool.abort()                 # in-flight requests resolve with their partials
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        self.stats.ended = self.clock()
        self._round_done = None
        if self._error is not None:
            raise self._error
        out, self.completed = self.completed[:target], self.completed[target:]
        return out

    # -- views -----------------------------------------------------------------------------
    def samples_of(self, group: Group, local_index: int = 0) -> list[Sample]:
        out = []
        for s in group.slots:
            smp = Sample(group.prompt_ids, list(s.response_ids), list(s.logprobs), list(s.versions),
                         s.finish_reason == "stop", local_index, group.record,
                         finish_reason=s.finish_reason or "abort", old_logprobs=list(s.old_logprobs),
                         uid=group.gid)
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
        open_tokens = [s for g in self.groups.values() for s in g.slots if s.response_ids and not s.finished]
        out = {"rollout_inflight_mean": st.inflight_area / wall, "rollout_concurrency": self.concurrency,
               "engine_busy_frac": st.busy_area / wall / max(1, len(self.pool.engines)),
               "rollout_requests": st.requests, "rollout_tokens": st.tokens,
               "carried_samples": len(open_tokens), "aborted_inflight": st.carried,
               "restarted_samples": st.restarted, "dropped_groups": st.dropped_groups,
               "groups_emitted": st.groups_emitted, "open_groups": len(self.groups),
               "completed_waiting": len(self.completed)}
        if st.inflight_min is not None:   # absent when the round had its groups without generating
            out["rollout_inflight_min"] = st.inflight_min
        return out

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain lists and numbers: the carry, open and completed groups, the group counter."""
        if self._inflight:
            raise RuntimeError("controller state saved while requests are in flight: save between rounds")
        return {"next_gid": self.next_gid, "open": [group_state(g) for g in self.groups.values()],
                "completed": [group_state(g) for g in self.completed]}

    def load_state_dict(self, state: dict) -> None:
        def group_of(d: dict) -> Group:
            return Group(d["gid"], d["record"], list(d["prompt_ids"]), [Slot(**s) for s in d["slots"]],
                         d["reward_done"], list(d["rewards"]))
        self.next_gid = state["next_gid"]
        self.groups = {d["gid"]: group_of(d) for d in state["open"]}
        self.completed = [group_of(d) for d in state["completed"]]
