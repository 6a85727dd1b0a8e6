"""Group filters (`rollout.group_filter`): DAPO's dynamic sampling, done as each group is scored.

A group whose samples teach nothing (all rewards equal: a group-relative advantage is zero for
every token) costs a step's room and trains nothing. Peers generate a batch, filter it and
generate again (veRL's `max_num_gen_batches`), idling the engines between batches. Here a group
is judged the moment it is scored, in every rollout mode:
- partial (and async, episodes): in the controller, where a complete group is queued
  (`serving.Serving._queue`). A dropped group is never trained: it leaves the controller (its
  room in the step and its staleness deadline with it), and admission opens the next prompt
  in the same event-loop turn, so concurrency stays fixed.
- sync (and rollout.lag, whose rounds are sync rounds): `fill_groups` draws replacement
  prompts until `train.groups_per_step` groups pass.
- service: where the agents' episodes complete a group (`service/groups.py`).
`rollout.group_filter_max_draws` = D: a step may draw D prompts per trained group; past that the
run stops with one line (`exhausted`): a task the policy has solved, or cannot solve at all,
ends the run instead of spinning.

A filter is a function of the group's samples (rewards set) returning True to keep it:
built-ins are registered in `GROUP_FILTERS` (config/registry.py) below; a user's is named by
import path (`package.module:attr` or `file.py:attr`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from megarl.config.registry import GROUP_FILTERS
from megarl.data.sample import Sample

KEY, DRAWS_KEY = "rollout.group_filter", "rollout.group_filter_max_draws"


@GROUP_FILTERS.register("none")
def keep_all(samples: Sequence[Sample]) -> bool:
    """Every group trains (the default)."""
    return True


@GROUP_FILTERS.register("zero_variance")
def zero_variance(samples: Sequence[Sample]) -> bool:
    """Keep a group whose rewards differ: one whose samples all scored the same has zero
    group-relative advantage everywhere (DAPO's dynamic sampling)."""
    rewards = [s.reward for s in samples]
    return not rewards or max(rewards) != min(rewards)


class GroupFilterExhausted(RuntimeError):
    """A step drew `rollout.group_filter_max_draws` prompts per trained group without enough passing."""


@dataclass
class GroupFilter:
    """The run's filter: `judge(samples)` -> keep; the draw cap; the run's counts (checkpointed)."""
    name: str = "none"
    fn: Callable[[Sequence[Sample]], bool] = keep_all
    max_draws: int = 10
    filtered_total: int = 0     # groups dropped, whole run
    judged_total: int = 0       # groups judged (kept + dropped), whole run
    _marks: tuple = field(default=(0, 0), repr=False)   # the totals at the last `since_last`

    @property
    def active(self) -> bool:
        return self.fn is not keep_all

    def judge(self, samples: Sequence[Sample]) -> bool:
        """Keep the group? Counted; a verdict that is not a bool is refused in one line."""
        verdict = True if not self.active else self.fn(list(samples))
        if not isinstance(verdict, bool):
            raise TypeError(f"{KEY}={self.name!r} returned {verdict!r} ({type(verdict).__name__}) for a group: "
                            f"a group filter returns True (train the group) or False (drop it)")
        self.judged_total += 1
        self.filtered_total += not verdict
        return verdict

    def exhausted(self, dropped: int, target: int) -> bool:
        """A step that dropped `dropped` groups has drawn more than max_draws per trained group
        before getting its `target` (the most it may draw is max_draws x target)."""
        return self.active and dropped > (self.max_draws - 1) * target

    def error(self, step: int, dropped: int, target: int) -> GroupFilterExhausted:
        return GroupFilterExhausted(
            f"step {step}: {KEY}={self.name} dropped {dropped} groups before {target} passed "
            f"({DRAWS_KEY}={self.max_draws} prompts per trained group): the policy has solved the task, or "
            f"cannot solve it at all; stop here, change the data, or raise {DRAWS_KEY}")

    def since_last(self, trained: int) -> dict:
        """The filter metrics of the groups judged since the last call (the service's rounds:
        its groups are judged as the agents complete them), and the run's total."""
        dropped, judged = self.filtered_total - self._marks[0], self.judged_total - self._marks[1]
        self._marks = (self.filtered_total, self.judged_total)
        return {**filter_metrics(dropped, judged, trained), "groups_filtered_total": self.filtered_total}

    def state_dict(self) -> dict:
        return {"filtered_total": self.filtered_total, "judged_total": self.judged_total}

    def load_state_dict(self, state: dict | None) -> None:
        state = state or {}
        self.filtered_total = int(state.get("filtered_total", 0))
        self.judged_total = int(state.get("judged_total", 0))
        self._marks = (self.filtered_total, self.judged_total)


def build(name: str = "none", max_draws: int = 10) -> GroupFilter:
    """The filter `rollout.group_filter` names; bad inputs are one line each (ConfigError for an
    unknown name or an import path that does not load, ValueError for a cap under 1)."""
    if isinstance(max_draws, bool) or not isinstance(max_draws, int) or max_draws < 1:
        raise ValueError(f"{DRAWS_KEY}={max_draws!r}: must be an integer >= 1 (the prompts a step may draw per "
                         f"trained group; 1: any dropped group stops the run)")
    return GroupFilter(name, GROUP_FILTERS.get(name, KEY), max_draws)


def filter_metrics(dropped: int, judged: int, trained: int) -> dict:
    """A round's filter metrics: groups dropped, their share of the groups judged, and the
    prompts drawn (judged) per group the step trains."""
    return {"groups_filtered": dropped, "filtered_frac": dropped / max(1, judged),
            "prompts_drawn_per_trained_group": judged / max(1, trained)}


def zero_advantage_frac(samples: Sequence[Sample]) -> float:
    """The share of the trained groups (by uid) whose rewards are all equal: a group-relative
    estimator (GRPO, RLOO, ...) gives every token of them zero advantage."""
    groups: dict = {}
    for s in samples:
        groups.setdefault((s.uid, s.group), []).append(s.reward)
    flat = sum(1 for r in groups.values() if max(r) == min(r))
    return flat / max(1, len(groups))


def fill_groups(draw: Callable[[int, int], list[list[Sample]]], target: int, filt: GroupFilter,
                step: int) -> tuple[list[list[Sample]], dict]:
    """Sync mode: `draw(count, k)` (the k-th draw of the step) returns `count` scored groups;
    draw replacements for the dropped ones until `target` pass, at most max_draws x target
    prompts in all. Returns the kept groups (Sample.group renumbered to their place in the
    step) and the round's filter metrics."""
    kept, drawn, dropped, k = [], 0, 0, 0
    while len(kept) < target:
        if filt.exhausted(dropped, target):
            raise filt.error(step, dropped, target)
        count = min(target - len(kept), filt.max_draws * target - drawn)
        for group in draw(count, k):
            if filt.judge(group):
                kept.append(group)
            else:
                dropped += 1
        drawn, k = drawn + count, k + 1
    for i, group in enumerate(kept):
        for s in group:
            s.group = i
    return kept, filter_metrics(dropped, drawn, len(kept))
