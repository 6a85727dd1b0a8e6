"""Reward functions by name: ``get_reward_fn(name)(response_text, record, *, finished) -> float``."""

from __future__ import annotations

from typing import Callable

from megarl.rewards import countdown

RewardFn = Callable[..., float]

def _no_verifier(response_text: str, record: dict, *, finished: bool) -> float:
    """reward.fn=none: the reward model alone scores (see megarl.rewards.model)."""
    return 0.0


REWARD_FNS: dict[str, RewardFn] = {"countdown": countdown.score, "none": _no_verifier}


def get_reward_fn(name: str) -> RewardFn:
    """Look up a reward function; unknown names raise ValueError listing the known ones."""
    try:
        return REWARD_FNS[name]
    except KeyError:
        known = ", ".join(sorted(REWARD_FNS))
        raise ValueError(f"unknown reward function {name!r}; known: {known}") from None
