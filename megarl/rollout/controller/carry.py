"""The carry: what happens to the controller's requests in flight when a round ends and
around a weight update (`rollout.update_mode`).

keep: the engines pause with the requests held; their tokens so far are copied into their
slots (`pool.partial`), so the trainer's l_old, a checkpoint and the staleness rules see every
token; after the update the same requests go on under the new version. abort: the requests are
aborted and resolve into their slots; each is sent again as a continuation in a later round.

`CarryOver` is a part of `PartialRolloutController` (partial.py), split out by concept: it
works on the controller's request book (`_inflight`, `_base`, `_tasks`), its groups and its
round state, on the controller's loop thread.
"""
from __future__ import annotations

import asyncio

from megarl.rollout.controller import staleness
from megarl.rollout.controller.slots import set_tokens


class CarryOver:
    """Holding, releasing and carrying the round's requests (a base of the controller)."""

    @property
    def keeps(self) -> bool:
        """rollout.update_mode=keep: requests live through weight updates and round ends."""
        return getattr(self.pool, "update_mode", "abort") == "keep"

    def _prompt_len(self, slot) -> int:
        """Tokens of the slot's group prompt (where its routes' response rows begin)."""
        group = self.groups.get(slot.gid)
        return len(group.prompt_ids) if group is not None else 0

    def _sync_live(self) -> None:
        """Copy what each request in flight has produced so far into its slot (keep mode): the
        trainer's l_old, a checkpoint and the staleness rules see every token generated."""
        for key, slot in self._inflight.items():
            now = self.pool.partial(key)
            if now is not None and self._current(key, slot):
                set_tokens(slot, self._base.get(key, 0), now, self.episodes is not None, self._prompt_len(slot))

    async def hold(self, scoring: bool = False) -> None:
        """Stop admitting, so the engines can take new weights in the middle of a round (async
        mode); `release()` continues the round. The pool calls both around every weight update.
        abort mode: also abort what this controller has in flight (tokens stay in their slots);
        keep mode: it stays, held by the pause the update makes.
        `scoring`: also wait for the groups being scored (a snapshot needs them settled)."""
        self._on_loop("hold")
        self._holding = True
        if not self.keeps:
            await self._abort_own()
        await self._settle_env()
        if scoring and self._scoring:
            await asyncio.gather(*list(self._scoring), return_exceptions=True)
        self._sample_occupancy()

    def release(self) -> None:
        self._on_loop("release")
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
        # (any stale slot: drop takes the whole group); a request whose slot is void already
        # (restarted, or its group dropped, since it was sent) goes too
        stale = [k for k, s in self._inflight.items()
                 if not self._current(k, s) or staleness.stale_slots(self.groups[s.gid], version, self.max_staleness)]
        if stale:
            await self.pool.abort(stale)
            # abort() returns once the engines resolved them; their _serve continuations (which
            # put the tokens into the slots and unbook them) run in the next loop iterations
            for _ in range(1000):
                if not any(k in self._inflight for k in stale):
                    break
                await asyncio.sleep(0)
        # an environment answering now must not change a slot while the staleness rule runs
        # (the round's preparation follows without a pause: nothing interleaves after this)
        await self._settle_env()

    def kv_dropped(self) -> None:
        """The pool's weight update is dropping the held requests' KV (keep mode,
        rollout.keep_kv=false): their response tokens so far are computed again, as a
        continuation's are in abort mode (counted alike: tokens beyond the group's prompt)."""
        self._on_loop("kv_dropped")
        self._sync_live()
        self._recomputed_total += sum(len(s.response_ids) for s in self._inflight.values())

    def _recomputed(self) -> int:
        """Response tokens whose KV the weight updates since the last call dropped."""
        out, self._recomputed_mark = self._recomputed_total - self._recomputed_mark, self._recomputed_total
        return out
