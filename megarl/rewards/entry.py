"""What the VERIFIERS registry holds per reward.fn: the function and the facts the run needs
about it, registered next to the function:

    @register_verifier("math", needs_answer=True, isolated=True)
    def math_score(response_text, record, *, finished, answer_key="answer") -> float: ...
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megarl.config.registry import VERIFIERS

RewardFn = Callable[..., float]


@dataclass(frozen=True)
class VerifierEntry:
    fn: RewardFn            # fn(response_text, record, *, finished[, answer_key]) -> float
    needs_answer: bool      # compares with the gold answer data.answer_key (the loader checks every row has it)
    isolated: bool          # can hang (sympy / LaTeX parsing): runs in a worker process that can be killed


def register_verifier(name: str, *, needs_answer: bool = False, isolated: bool = False):
    """Decorator: register `fn` as reward.fn=`name`. A verifier that needs the gold answer takes
    it as the `answer_key` keyword; an isolated one must be a module-level function (it travels
    pickled by reference to the worker process)."""
    def add(fn: RewardFn) -> RewardFn:
        VERIFIERS.register(name, VerifierEntry(fn, needs_answer, isolated))
        return fn
    return add
