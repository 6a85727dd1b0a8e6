"""Verifiers by name: ``get_reward_fn(name)(response_text, record, *, finished) -> float``.

Each verifier registers itself in megarl.config.registry.VERIFIERS next to its code
(`register_verifier`, megarl.rewards.entry), with what it needs: the gold answer, a worker
process. Importing this package registers the built-in ones; a verifier outside megarl is
named by import path (reward.fn=package.module:function or path/to/file.py:function) and
marked with `@verifier(needs_answer=..., isolated=..., batched=...)` (an `async def` is awaited).
`build_verifier` wraps one for the run: scored off the caller's thread, errors and timeouts
score 0 and are counted (megarl.rewards.runner). Names, formats and what each needs: docs/data.md.
"""

from __future__ import annotations

from megarl.config.registry import VERIFIERS
from megarl.rewards import answer, countdown  # noqa: F401 - importing them registers their verifiers
from megarl.rewards import math as math_reward  # noqa: F401
from megarl.rewards.entry import RewardFn, VerifierEntry, register_verifier, verifier  # noqa: F401 - for users
from megarl.rewards.runner import RewardOutputError, RewardRunner  # noqa: F401 - RewardOutputError: for callers


@register_verifier("none")
def no_verifier(response_text: str, record: dict, *, finished: bool) -> float:
    """reward.fn=none: the reward model alone scores (see megarl.rewards.model)."""
    return 0.0


def verifier_entry(name: str) -> VerifierEntry:
    """The verifier `name` (registered, or an import path); an unknown name or a bad path raises
    ConfigError (a ValueError) naming reward.fn, the value and the fix."""
    return VERIFIERS.get(name)


def get_reward_fn(name: str) -> RewardFn:
    """The function of verifier `name` (unknown names: see `verifier_entry`)."""
    return verifier_entry(name).fn


def needs_answer(name: str) -> bool:
    """Does verifier `name` compare with the gold answer `data.answer_key`?"""
    return verifier_entry(name).needs_answer


def build_verifier(name: str, *, timeout_s: float, answer_key: str = "answer", concurrency: int = 1,
                   batch_size: int = 0) -> RewardRunner:
    """The run's reward: verifier `name` (any kind), reading the gold answer from `answer_key`,
    `concurrency` calls at once, a batched one given up to `batch_size` samples (whole groups),
    with errors and timeouts counted (`take_counts()`) instead of raised."""
    entry = verifier_entry(name)
    return RewardRunner(entry, timeout_s=timeout_s, concurrency=concurrency, batch_size=batch_size, name=name,
                        kwargs={"answer_key": answer_key} if entry.needs_answer else None)
