"""Intra-step overlap (rollout.overlap): the step's forward-only passes for groups emitted while
the round still generates, run on every trainer rank during the round.

- `Overlap.serve(step, ...)` (collective, during round `step`): the driver polls the round;
  whenever complete, scored groups exist that the cache lacks, it broadcasts their samples
  and every rank runs the passes on them together (DP split + gather, megatron's PP
  schedule), storing each row's values in a `PassCache`; at the round's end it broadcasts
  "done".
- `Overlap.forward(samples, batch, step)`: the `forward` of `ppo.step.ppo_step` and
  `rewards.model.sequence_scores`: each row's values from the cache where they match, the
  missing groups computed now, in the same layout.
- `Overlap.after_update(samples)`: the step's metrics; the values of the trained weights
  dropped (the next step trains from new ones), frozen models' values kept for groups that
  still wait.

Layout (measured on CPU, docs/partial_rollout.md "Intra-step overlap"): a row's values do not
depend on which rows share its micro-batch, but they do depend on the padded sequence length
(its micro-batch's longest row; up to 1.5e-6 in a logprob). So with overlap on, every group is
computed alone, planned by the step's batching rule over its own rows (ppo/microbatch.py:
split over DP, micro-batches padded to their own longest), whether during the round or after
it: a row's values then depend only on its group and the weights, and overlap equals the same
passes after the round bitwise.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from megarl.data.sample import Sample
from megarl.distributed.env import from_rank0
from megarl.models.offload import resident
from megarl.ppo.batch import Batch, build_batch
from megarl.ppo.microbatch import Batching, as_batching
from megarl.ppo.schedule import forward_all
from megarl.ppo.step import Pass

POLL_S = 0.05   # how often the driver looks for new groups while the round runs
# groups per broadcast: the driver looks at the round again after each batch of passes, so
# the round's end waits for at most these (groups it does not select are wasted work)
GROUPS_PER_MESSAGE = 4

Key = tuple[int, int]   # (Sample.uid, the sample's index in its group)


def row_keys(samples: list[Sample]) -> list[Key]:
    """(uid, index in group) of each sample; a group's samples are consecutive, in slot order
    (`controller.samples_of`)."""
    seen: dict[int, int] = {}
    out = []
    for s in samples:
        out.append((s.uid, seen.get(s.uid, 0)))
        seen[s.uid] = out[-1][1] + 1
    return out


def _fingerprint(s: Sample) -> tuple:
    return tuple(s.prompt_ids), tuple(s.response_ids)


def groups_of(samples: list[Sample]) -> list[list[int]]:
    """Positions of each group's samples (consecutive runs of one uid), in order."""
    out: list[list[int]] = []
    for i, s in enumerate(samples):
        if out and samples[out[-1][0]].uid == s.uid:
            out[-1].append(i)
        else:
            out.append([i])
    return out


@dataclass
class _Entry:
    fingerprint: tuple
    version: int | None   # the weights' version for a versioned pass; None: a frozen model's
    row: torch.Tensor     # [response length] (at least 1 column)


class PassCache:
    """Per-row values of forward-only passes, by (pass name, uid, index in group). A value is
    used only for the same tokens (prompt and response) and, for a pass of the trained models,
    the same weight version."""

    def __init__(self):
        self._rows: dict[tuple[str, Key], _Entry] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def put(self, p: Pass, version: int, key: Key, sample: Sample, row: torch.Tensor) -> None:
        self._rows[(p.name, key)] = _Entry(_fingerprint(sample), version if p.versioned else None, row)

    def get(self, p: Pass, version: int, key: Key, sample: Sample) -> torch.Tensor | None:
        e = self._rows.get((p.name, key))
        if e is None or e.fingerprint != _fingerprint(sample):
            return None
        if p.versioned and e.version != version:
            return None
        return e.row

    def has_group(self, passes: list[Pass], version: int, samples: list[Sample]) -> bool:
        return all(self.get(p, version, k, s) is not None
                   for p in passes for k, s in zip(row_keys(samples), samples))

    def after_update(self, keep_uids: set[int]) -> None:
        """The weights changed: drop every versioned value; keep frozen models' values of the
        groups in `keep_uids` (emitted, not trained yet)."""
        self._rows = {k: e for k, e in self._rows.items() if e.version is None and k[1][0] in keep_uids}


def group_rows(p: Pass, samples: list[Sample], pad_id: int, batching: Batching) -> list[torch.Tensor]:
    """`p`'s values of one group's rows, in a layout that depends on the group alone: its own
    batch, planned by `batching` over its rows (split over DP, each micro-batch padded to its
    own longest), gathered back. Collective over all trainer ranks. Each row trimmed to its
    response. The caller holds `p.resident` (once for all the groups it computes)."""
    batch = build_batch(samples, pad_id, batching.multiple)
    with torch.no_grad():
        full = forward_all(p.fn, p.model, batch, batching)
    return [full[i, :max(1, len(s.response_ids))] for i, s in enumerate(samples)]


class Overlap:
    """The pass cache of one trainer rank and the collective protocol that fills it."""

    def __init__(self, passes: list[Pass], pad_id: int, multiple: int, micro_batch_size: int | Batching):
        """`micro_batch_size`: the step's batching rule (microbatch.batching_of) or a row count;
        `multiple`: the sequence-length multiple (TP with sequence parallelism)."""
        self.passes, self.pad_id = passes, pad_id
        self.batching = replace(as_batching(micro_batch_size), multiple=multiple)
        self.cache = PassCache()
        self.seconds = 0.0           # spent on passes during the last round
        self._live: set[int] = set()  # uids of the groups left waiting at the last round's end
        self._hits = self._lookups = 0

    def _compute(self, groups: list[list[Sample]], version: int) -> None:
        for p in self.passes:
            todo = [g for g in groups if not self.cache.has_group([p], version, g)]
            if not todo:
                continue
            with resident(p.resident):   # an offloaded model comes back once for all the groups
                for samples in todo:
                    rows = group_rows(p, samples, self.pad_id, self.batching)
                    for k, s, row in zip(row_keys(samples), samples, rows):
                        self.cache.put(p, version, k, s, row)

    def serve(self, step: int, finished: Callable[[float], bool] | None = None,
              emitted: Callable[[set], tuple[list[int], list[list[Sample]]]] | None = None) -> float:
        """Collective, while round `step` runs (the weights are version `step`). The driver
        passes `finished(timeout) -> bool` (the round ended) and `emitted(seen) -> (uids of
        every complete, scored group not taken by a step, the samples of those not in seen)`
        (`Rollout.round`); the others None. After the round the uids are the groups left
        waiting: their frozen models' values are kept over the update.
        Returns (and keeps in `seconds`) the time spent on passes."""
        self.seconds, seen = 0.0, set()
        while True:
            message = None
            if finished is not None:
                message = self._next_message(step, finished, emitted, seen)
                if message is None:
                    continue
            kind, payload = from_rank0(message)
            if kind == "done":
                self._live = set(payload)
                return self.seconds
            t0 = time.perf_counter()
            self._compute(payload, step)
            self.seconds += time.perf_counter() - t0

    def _next_message(self, step: int, finished, emitted, seen: set) -> tuple | None:
        """The driver's next broadcast: ("done", uids left waiting), ("groups", samples of up
        to GROUPS_PER_MESSAGE groups the cache lacks), or None (nothing new yet). `seen`:
        uids sent or found cached this round."""
        if finished(POLL_S):
            return "done", emitted(seen)[0]
        _, fresh = emitted(seen)
        need = []
        for g in fresh:
            if self.cache.has_group(self.passes, step, g):
                seen.add(g[0].uid)
            elif len(need) < GROUPS_PER_MESSAGE:
                need.append(g)
                seen.add(g[0].uid)
        return ("groups", need) if need else None

    def forward(self, samples: list[Sample], batch: Batch, step: int) -> Callable[[Pass], torch.Tensor]:
        """The step's `forward(pass) -> [B, R]`: cached rows as they are, every other group
        computed now by `group_rows` (collective: every rank has the same cache)."""
        keys, groups = row_keys(samples), groups_of(samples)

        def run(p: Pass) -> torch.Tensor:
            rows: list[torch.Tensor | None] = [self.cache.get(p, step, k, s) for k, s in zip(keys, samples)]
            todo = [where for where in groups if any(rows[i] is None for i in where)]
            self._lookups += len(rows)
            self._hits += len(rows) - sum(len(where) for where in todo)
            if todo:
                with resident(p.resident):
                    for where in todo:   # a group is computed whole, never in part
                        computed = group_rows(p, [samples[i] for i in where], self.pad_id, self.batching)
                        for i, row in zip(where, computed):
                            rows[i] = row
            out = torch.zeros(batch.resp_mask.shape, dtype=rows[0].dtype, device=batch.device)
            for i, row in enumerate(rows):
                out[i, :row.shape[0]] = row
            return out
        return run

    def after_update(self, samples: list[Sample]) -> dict:
        """The step's metrics; then the cache forgets what the new weights change and the
        groups just trained."""
        trained = {s.uid for s in samples}
        out = {"overlap_forward_s": self.seconds, "overlap_rows": self._hits / max(1, self._lookups)}
        self.cache.after_update(self._live - trained)
        self._hits = self._lookups = 0
        return out
