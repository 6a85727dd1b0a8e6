"""Verifiers by name: ``get_reward_fn(name)(response_text, record, *, finished) -> float``.

`build_verifier` wraps one for the run: errors and timeouts score 0 and are counted
(megarl.rewards.verify). Names, formats and what each needs: docs/data.md.
"""

from __future__ import annotations

from typing import Callable

from megarl.rewards import answer, countdown
from megarl.rewards import math as math_reward

RewardFn = Callable[..., float]

def _no_verifier(response_text: str, record: dict, *, finished: bool) -> float:
    """reward.fn=none: the reward model alone scores (see megarl.rewards.model)."""
    return 0.0


REWARD_FNS: dict[str, RewardFn] = {
    "countdown": countdown.score,
    "math": math_reward.math_score,
    "exact": answer.exact_score,
    "format": answer.format_score,
    "none": _no_verifier,
}
#: verifiers that compare with the gold answer `data.answer_key` (the loader checks every row has it)
NEEDS_ANSWER = frozenset({"math", "exact"})
#: verifiers that can hang (sympy / LaTeX parsing): run in a worker process that can be killed
ISOLATED = frozenset({"math"})


def get_reward_fn(name: str) -> RewardFn:
    """Look up a reward function; unknown names raise ValueError listing the known ones."""
    try:
        return REWARD_FNS[name]
    except KeyError:
        known = ", ".join(sorted(REWARD_FNS))
        raise ValueError(f"unknown reward function {name!r}; known: {known}") from None


def build_verifier(name: str, *, timeout_s: float, answer_key: str = "answer"):
    """The run's reward_fn: verifier `name`, reading the gold answer from `answer_key`, with
    errors and timeouts counted (`take_counts()`) instead of raised."""
    from megarl.rewards.verify import Verifier
    fn = get_reward_fn(name)
    return Verifier(fn, timeout_s=timeout_s, isolate=name in ISOLATED, name=name,
                    kwargs={"answer_key": answer_key} if name in NEEDS_ANSWER else None)
