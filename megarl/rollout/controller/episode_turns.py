"""The controller's side of multi-turn episodes: a slot's first request waits for its
environment, a model turn ending on EOS hands the slot to its environment, and a round's end or
a snapshot waits for the environments answering (`megarl/envs/episodes.py` is the
environment's side).

`EpisodeTurns` is a part of `PartialRolloutController` (partial.py), split out by concept:
it works on the controller's groups, its request book and `episodes` (an
`envs.episodes.EpisodeDriver`), on the controller's loop thread.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Optional

from megarl.rollout.controller.slots import Slot
from megarl.rollout.engines.engine import GenRequest


class EpisodeTurns:
    """Environment turns between model turns (a base of the controller)."""

    async def _episode_request(self, req: GenRequest, slot: Slot) -> Optional[GenRequest]:
        """An episode's request once its environment is live: None if the episode ended
        (reset failed); rebuilt if reset appended a first observation."""
        before = len(slot.response_ids)
        task = asyncio.ensure_future(self.episodes.ensure(slot, self.groups[slot.gid], self._budget(slot),
                                                          self.pool.version))
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

    def _episode_metrics(self) -> dict:
        """Episodes carried into the next round: between turns (the environment answered, the
        next model turn not started) and mid-turn (a model turn begun); the environments' counts."""
        open_slots = [s for g in self.groups.values() for s in g.slots if not s.done and s.response_ids]
        mid_turn = sum(len(s.response_ids) > s.turn_base for s in open_slots)
        return {"episodes_carried_mid_turn": mid_turn,
                "episodes_carried_between_turns": len(open_slots) - mid_turn,
                **self.episodes.take_metrics()}
