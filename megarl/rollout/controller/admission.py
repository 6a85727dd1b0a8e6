"""Admission in the partial-rollout controller: which waiting sample is sent next, as which
request, to which engine, up to `rollout.partial.concurrency` in flight.

Frontier-first (docs/partial_rollout.md): samples of groups due this step (stale_policy=finish),
then carried samples (tokens already generated), then the waiting samples of the groups closest
to completion, then a new group, opened only while the staleness window has room
(staleness.new_group_deadline). A request goes to the engine with the fewest of the
controller's requests.

`Admission` is a part of `PartialRolloutController` (partial.py), split out by concept: it
works on the controller's groups, its request book and its round state, on its loop thread.
"""
from __future__ import annotations

from typing import Optional

from megarl.data import seeds
from megarl.rollout.controller import staleness
from megarl.rollout.controller.slots import Group, Slot
from megarl.rollout.engines.engine import GenRequest


class Admission:
    """Filling the round's free places (a base of the controller)."""

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
                                                    self.max_staleness, self.step_cap)
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
            self._gen[req.key] = slot.restarts
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
                          self.temperature, top_p=self.top_p, top_k=self.top_k, ignore_eos=self.ignore_eos,
                          # a function of how far the slot got: a rerun draws the same tokens
                          seed=seeds.request_seed(slot.seed, len(slot.response_ids), slot.restarts))
