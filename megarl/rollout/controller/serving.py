"""Serving in the partial-rollout controller: a request's result into its slot, and a complete
group scored and queued for the trainer.

A request's result is absorbed into its slot when the request still serves the slot as it
was when sent (neither restarted nor its group dropped since); a request the engine refuses
ends its sample refused (scored 0); an engine failure ends the round. A group whose samples
are all done is scored (off the loop when a `scorer` is given: an executor running `score`, or
a coroutine function awaited while the loop serves on), judged by the group
filter (rollout.group_filter, `group_filter.py`: a dropped group leaves, its place goes to the
next prompt) and queued in `completed`, unless a staleness rule changed its samples meanwhile;
a finished request is replaced at once (`Admission._fill`).

`Serving` is a part of `PartialRolloutController` (partial.py), split out by concept: it
works on the controller's groups, its request book (`_inflight`, `_base`, `_gen`, `_busy`,
`_load`) and its round state, on the controller's loop thread.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from typing import Callable

from megarl.data.sample import Sample
from megarl.distributed import faults
from megarl.rollout.controller.slots import Group, Slot, sample_identity, set_tokens
from megarl.rollout.controller.sync_rollout import REFUSED
from megarl.rollout.engines.engine import GenRequest, GenResult, RequestError

log = logging.getLogger("megarl.engines")


def _score_all(score: Callable[[Sample], float], samples: list[Sample]) -> list[float]:
    """Each sample's reward; a refused one scores 0 without the verifier (or its environment's
    rewards so far): the environment contract's failed sample."""
    return [0.0 if s.finish_reason == REFUSED else score(s) for s in samples]



class Serving:
    """Requests' results into their slots, complete groups into the queue (a base of the controller)."""

    async def _serve(self, req: GenRequest, slot: Slot, engine) -> None:
        key, refused = req.key, None
        try:
            if self.episodes is not None and not self.episodes.live(slot):   # its first turn, or resumed
                req = await self._episode_request(req, slot)
            result = None if req is None else await self.pool.generate(req, engine)
        except RequestError as err:    # the request's own fault (the engine is fine): its sample fails
            result, refused = None, err
        except BaseException as err:   # an engine failure ends the round with the error
            self._unbook(key, slot, engine)
            self._fail(err)
            if isinstance(err, asyncio.CancelledError):
                raise
            return
        base, current = self._base.get(key, 0), self._current(key, slot)
        self._unbook(key, slot, engine)
        try:
            group = self.groups.get(slot.gid)   # before any await: a slot finishing meanwhile may emit it
            if current:   # else the slot was restarted or its group dropped meanwhile: the result is void
                if refused is not None:
                    self._refuse(slot, refused)
                elif result is not None:
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

    def _refuse(self, slot: Slot, err: RequestError) -> None:
        """The engine refused the slot's request as invalid (a prompt past its max_model_len,
        ...): not retried (it would be refused again), not restarted (its prompt is the same);
        the sample ends refused with what it holds and scores 0. The round goes on."""
        slot.finish_reason = REFUSED
        if self.episodes is not None:
            self.episodes.finish(slot, REFUSED)
        self.stats.refused += 1
        self._refusal = self._refusal or err
        self._refused_total += 1
        if self._refused_total <= 3:   # the first few with the engine's message; then counted only
            log.warning("megarl: sample %d of group %d ends refused, scored 0 (refused_samples): %s",
                        slot.index, slot.gid, err)

    def _current(self, key: str, slot: Slot) -> bool:
        """The request `key` still serves its slot as it was when sent: neither restarted nor
        its group dropped since (a staleness rule acting on a held request's slot cannot rewind
        the request: what it produced belongs to samples that no longer exist)."""
        group = self.groups.get(slot.gid)
        return (group is not None and slot.index < len(group.slots) and group.slots[slot.index] is slot
                and self._gen.get(key) == slot.restarts)

    def _unbook(self, key: str, slot: Slot, engine) -> None:
        self._load[engine.name] = self._load.get(engine.name, 1) - 1
        self._inflight.pop(key, None)
        self._base.pop(key, None)
        self._gen.pop(key, None)
        self._busy.discard((slot.gid, slot.index))

    def _absorb(self, slot: Slot, r: GenResult, base: int) -> None:
        """The request's result after the `base` tokens its slot had when it was sent (what a
        held request's slot got from `_sync_live` since is a prefix of it)."""
        faults.point("rollout_result")
        set_tokens(slot, base, r, self.episodes is not None, self._prompt_len(slot))
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
        """Score a complete group and queue it: at once on the loop, or off it by `scorer` (the
        loop goes on serving meanwhile; a verifier may take seconds)."""
        group.reward_done = True   # never scored twice
        samples, scored = self.samples_of(group), sample_identity(group)
        if self.scorer is None:
            self._queue(group, scored, _score_all(self.score, samples))
        else:
            self._track(self._scoring, self._score_off_loop(group, scored, samples))

    async def _score_off_loop(self, group: Group, scored: tuple, samples: list[Sample]) -> None:
        try:
            if isinstance(self.scorer, Executor):
                rewards = await asyncio.get_running_loop().run_in_executor(self.scorer, _score_all, self.score, samples)
            else:   # the run's reward runner (rollout/controller/scoring.py score_group)
                rewards = await self.scorer(samples)
        except BaseException as err:   # noqa: BLE001 - e.g. the verifier's worker cannot start
            self._fail(err)
            return
        self._queue(group, scored, rewards)

    def _queue(self, group: Group, scored: tuple, rewards: list[float]) -> None:
        """Queue a scored group for the trainer, if the score is of its samples as they are now.
        A staleness rule may restart them (or drop the group) while it is scored off the loop
        (keep mode: a group completes between rounds, the next round's rule acts before the score
        lands); such a score is void: the group is scored again once complete again."""
        if self.groups.get(group.gid) is not group or sample_identity(group) != scored:
            self.stats.void_scores += 1
            return
        group.rewards = list(rewards)
        del self.groups[group.gid]
        try:
            # the group's samples are built only for a filter that reads them (off by default:
            # this runs on the loop for every scored group)
            keep = self.group_filter.judge(self.samples_of(group) if self.group_filter.active else ())
        except Exception as err:   # noqa: BLE001 - a user's filter failing ends the round with its error
            self._fail(err)
            return
        if not keep:
            self._filtered(group)
            return
        self.completed.append(group)
        self.stats.groups_emitted += 1
        self._maybe_end()

    def _filtered(self, group: Group) -> None:
        """rollout.group_filter dropped the scored group: it is never trained. Gone from the
        controller, it holds no room in any step and no deadline (a due one no longer holds the
        round's end); admission opens the next prompt in its place. A step that drew more than
        rollout.group_filter_max_draws prompts per trained group ends the run (one line)."""
        self.stats.groups_filtered += 1
        if self._round_done is None:   # between rounds (keep mode): the next round admits
            return
        if len(self.completed) < self._target and self.group_filter.exhausted(self.stats.groups_filtered,
                                                                              self._target):
            self._fail(self.group_filter.error(self._train_version, self.stats.groups_filtered, self._target))
            return
        try:
            self._maybe_end()
            self._fill()
        except Exception as err:   # noqa: BLE001 - the data stream, the next request: end the round
            self._fail(err)
