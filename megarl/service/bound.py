"""The staleness bound on what the agent service hands to the trainer.

Outside agents run episodes for as long as they like, and complete groups may wait for the
trainer; without a bound a step would train tokens of any age. The service keeps
`rollout.partial.max_staleness` as the partial-rollout controller does (the rule itself:
megarl/rollout/controller/staleness.py, the model's tokens only): before a step takes its groups, a
rewarded sample holding a model token past the bound is not trained. An outside agent cannot
be made to finish sooner (the controller's `finish`) nor rewound, so the sample's place in its
group is handed out again to the next episode start (`restart`, also what `finish` does here),
or, with `rollout.partial.stale_policy=drop`, its whole group is dropped (the record is not
handed out again). Counted: agent_stale_restarted, agent_stale_groups_dropped,
agent_stale_tokens_discarded.
"""
from __future__ import annotations

from typing import Callable

from megarl.data.sample import Sample
from megarl.rollout.controller.staleness import Discarded
from megarl.service.groups import GroupBook


def discard_stale(book: GroupBook, stale: Callable[[Sample], bool], drop: bool) -> Discarded:
    """Apply the bound to every rewarded sample of the untaken groups (complete or not):
    `stale(sample)` says it is past it. Mutates `book`; returns what was discarded."""
    out = Discarded()
    for serial in list(book.groups):
        group = book.groups[serial]
        old = [slot for slot, sample in group.samples.items() if stale(sample)]
        if not old:
            continue
        if drop:
            del book.groups[serial]
            out.dropped += 1
            out.tokens += sum(len(s.response_ids) for s in group.samples.values())
            continue
        for slot in old:
            out.tokens += len(group.samples.pop(slot).response_ids)
            book.give_back(group, slot)
            out.restarted += 1
    return out
