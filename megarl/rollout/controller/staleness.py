"""The staleness rules of the partial rollout (`rollout.partial.stale_policy`, `rollout.partial.max_staleness` = S),
as functions of plain data: groups and slots are the controller's (`controller.Group` /
`Slot`), read through their attributes only. docs/partial_rollout.md explains the policies.

- finish (default): every untrained group has a deadline, the step that must train it at the
  latest. A new group gets the latest step with room (fewer than groups_per_step groups due
  there) no later than v + S, v the engines' version when it opens: its first token comes at
  a version >= v, so training it by its deadline keeps every token within S versions. No
  room: the group is not opened. The controller finishes the groups due at a step before that
  step's round may end, and trains due groups first, then the oldest complete ones: the
  deadline is a guard, not an order (with S unbounded nothing is ever due).
- restart / drop: before a round, a sample holding a token more than S versions old is
  restarted from its prompt, or its whole group dropped.
Only the model's tokens count (`model_versions`): an episode's observation tokens (mask 0) are
context the environment appended, never trained, so they make no sample stale.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

POLICIES = ("finish", "restart", "drop")


@dataclass
class Discarded:
    """What keeping the bound threw away (restart / drop; finish only for a restored carry
    already past the bound)."""
    restarted: int = 0     # samples restarted from their prompt
    dropped: int = 0       # groups dropped
    tokens: int = 0        # tokens generated and never to be trained


def free_deadline(taken: Counter, earliest: int, latest: int, per_step: int) -> Optional[int]:
    """The latest step d in [earliest, latest] with fewer than `per_step` groups due at d, or
    None (the window is full: admission waits). The latest: a group is forced to finish as
    late as the bound allows (earliest-first made an unbounded run wait for each step's
    groups in turn, like sync). The loop visits at most len(taken) + 1 steps, also for an
    unbounded max_staleness."""
    d = latest
    while d >= earliest:
        if taken[d] < per_step:
            return d
        d -= 1
    return None


def new_group_deadline(untrained, step: int, engine_version: int, max_staleness: int,
                       per_step: int) -> Optional[int]:
    """finish: the deadline of a group opened now for the round of `step`, or None. This
    round's own step comes last: a group due now holds the round's end, but refusing it
    outright throttles more than it saves (1.9x slower at S=1 on the workloads of
    tests/unit/test_rollout_stress.py)."""
    taken = Counter(g.deadline for g in untrained)
    return free_deadline(taken, step, engine_version + max_staleness, per_step)


def step_groups(complete: int, due: int, per_step: int, cap: int) -> int:
    """How many of `complete` groups a step trains (elastic steps, rollout.partial.max_step_multiple):
    whole multiples of `per_step` (train.groups_per_step), so each optimizer update sees the
    mini-batch of a fixed step; as many as are complete, up to `cap`; and always every one of
    the `due` groups (rounded up to a whole multiple), also past the cap (a restored carry).
    With cap == per_step: exactly per_step, the fixed step."""
    return max(_covering(due, per_step), min(cap, complete // per_step * per_step))


def round_may_end(complete: int, due_complete: int, due_open: int, per_step: int) -> bool:
    """A round may end once no group due at its step is open and the complete groups fill a
    step that trains every due one: at least per_step, and a whole multiple covering them."""
    return due_open == 0 and complete >= max(per_step, _covering(due_complete, per_step))


def _covering(due: int, per_step: int) -> int:
    """The smallest whole multiple of per_step that holds `due` groups."""
    return -(-due // per_step) * per_step


def training_order(group, step: int) -> tuple:
    """Sort key of the complete groups a step trains: due ones first (they must), then the
    oldest (the order the prompts were drawn in)."""
    due = group.deadline is not None and group.deadline <= step
    return (not due, group.gid)


def model_versions(slot) -> list[int]:
    """The versions of the slot's model tokens: every token of a single-turn sample (no mask),
    an episode's mask-1 tokens (its observation tokens are context, not the policy's)."""
    if not slot.mask:
        return slot.versions
    return [v for v, m in zip(slot.versions, slot.mask) if m]


def oldest(slot, default=None):
    """The version of the slot's oldest model token (`default` when it has none)."""
    return min(model_versions(slot), default=default)


def stale_sample(sample, step: int, max_staleness: int) -> bool:
    """A slot or Sample holds a model token more than max_staleness versions older than `step`."""
    v = oldest(sample)
    return v is not None and step - v > max_staleness


def stale_slots(group, step: int, max_staleness: int) -> list:
    """Slots of `group` holding a model token more than max_staleness versions older than `step`."""
    return [s for s in group.slots if stale_sample(s, step, max_staleness)]


def discard_stale(groups: dict, completed: list, step: int, max_staleness: int, drop: bool) -> tuple[list, Discarded]:
    """restart / drop, before the round of `step`: restart every stale sample (drop: its whole
    group), done samples and complete groups too, so the bound holds for everything the
    trainer will see. Mutates `groups` (open, by gid); returns the complete groups still
    complete and what was discarded."""
    out = Discarded()
    for group in completed:                     # complete but untrained: back to open if stale
        groups[group.gid] = group
    for gid in sorted(groups):
        group = groups[gid]
        stale = stale_slots(group, step, max_staleness)
        if stale and drop:
            del groups[gid]
            out.dropped += 1
            out.tokens += sum(len(s.response_ids) for s in group.slots)
            continue
        for s in stale:
            out.tokens += s.restart()
            out.restarted += 1
        if stale:
            group.reward_done, group.rewards = False, []
    still = [g for g in completed if g.gid in groups and g.complete]
    for group in still:
        del groups[group.gid]
    return still, out


def check_deadlines(groups: dict, completed: list, step: int, engine_version: int, max_staleness: int,
                    per_step: int) -> tuple[list, Discarded]:
    """finish, before the round of `step`: every untrained group gets a deadline in [step, its
    first token's version + S]. Groups without one (restored from a checkpoint of another
    policy, or of a larger max_staleness) get the latest free one, oldest group first; only a
    sample already past the bound is restarted (its group reopened if it was complete).
    Mutates `groups`; returns the complete groups and what was discarded."""
    out = Discarded()

    def latest(g) -> int:   # its first model token's version + S (no token yet: the engines' version)
        return min((v for s in g.slots for v in model_versions(s)), default=engine_version) + max_staleness

    def valid(g) -> bool:
        return g.deadline is not None and step <= g.deadline <= latest(g)

    untrained = [*groups.values(), *completed]
    taken = Counter(g.deadline for g in untrained if valid(g))
    for g in sorted(untrained, key=lambda g: g.gid):
        if valid(g):
            continue
        stale = stale_slots(g, step, max_staleness)
        for s in stale:
            out.tokens += s.restart()
            out.restarted += 1
        if stale:
            if g.gid not in groups:          # it was complete: open again
                completed = [c for c in completed if c is not g]
                groups[g.gid] = g
            g.reward_done, g.rewards = False, []
        g.deadline = free_deadline(taken, step, latest(g), per_step)
        if g.deadline is None:   # over-full (a larger groups_per_step before): train it first
            g.deadline = step
        taken[g.deadline] += 1
    return completed, out
