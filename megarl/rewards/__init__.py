"""Verifiers by name: ``get_reward_fn(name)(response_text, record, *, finished) -> float``.

Each verifier registers itself in megarl.config.registry.VERIFIERS next to its code
(`register_verifier`, megarl.rewards.entry), with what it needs: the gold answer, a worker
process. Importing this package registers the built-in ones; a verifier outside megarl is
named by import path (reward.fn=package.module:function or path/to/file.py:function) and
marked with `@verifier(needs_answer=..., isolated=...)`. `build_verifier` wraps one for the
run: errors and timeouts score 0 and are counted (megarl.rewards.verify). Names, formats and
what each needs: docs/data.md.
"""

from __future__ import annotations

from megarl.config.registry import VERIFIERS
from megarl.rewards import answer, countdown  # noqa: F401 - importing them registers their verifiers
from megarl.rewards import math as math_reward  # noqa: F401
from megarl.rewards.entry import RewardFn, VerifierEntry, register_verifier, verifier  # noqa: F401 - for users
from megarl.rewards.verify import Verifier


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


def build_verifier(name: str, *, timeout_s: float, answer_key: str = "answer") -> Verifier:
    """The run's reward_fn: verifier `name`, reading the gold answer from `answer_key`, with
    errors and timeouts counted (`take_counts()`) instead of raised."""
    entry = verifier_entry(name)
    return Verifier(entry.fn, timeout_s=timeout_s, isolate=entry.isolated, name=name,
                    kwargs={"answer_key": answer_key} if entry.needs_answer else None)
