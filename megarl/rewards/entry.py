"""What the VERIFIERS registry holds per reward.fn: the function and the facts the run needs
about it, registered next to the function:

    @register_verifier("math", needs_answer=True, isolated=True)
    def math_score(response_text, record, *, finished, answer_key="answer") -> float: ...

A verifier outside megarl is named by import path (reward.fn=package.module:function or
path/to/file.py:function) and says what it needs with `@verifier(...)` (`from_import` reads it).

Three kinds, one entry: a plain function scores one sample; `batched=True` takes lists (one
element per sample) and returns a list of floats; an `async def` (plain or batched) is awaited
on the reward runner's own event loop (megarl.rewards.runner). Its kind is read here, once.
"""
from __future__ import annotations

import inspect
import pickle
from dataclasses import dataclass
from typing import Callable

from megarl.config.extension import ExtensionError, a, check_call
from megarl.config.registry import VERIFIERS

RewardFn = Callable[..., float]
#: the attribute `verifier` sets on a function: its VerifierEntry
MARK = "__megarl_verifier__"


@dataclass(frozen=True)
class VerifierEntry:
    fn: RewardFn            # fn(response_text, record, *, finished[, answer_key]) -> float
    needs_answer: bool      # compares with the gold answer data.answer_key (the loader checks every row has it)
    isolated: bool          # can hang (sympy / LaTeX parsing): runs in a worker process that can be killed
    # fn(response_texts, records, *, finished[, answer_key]) -> list[float]: lists, one element per
    # sample, called with up to reward.batch_size samples (whole groups)
    batched: bool = False

    @property
    def is_async(self) -> bool:
        """An `async def`: awaited on the reward runner's loop (megarl.rewards.runner)."""
        return inspect.iscoroutinefunction(self.fn)


def verifier(*, needs_answer: bool = False, isolated: bool = False, batched: bool = False):
    """Decorator: what verifier `fn` needs, for reward.fn=module:fn. A verifier that needs the
    gold answer takes it as the `answer_key` keyword; an isolated one runs in a worker process
    (megarl.rewards.verify), so it must be a module-level function; a batched one takes lists
    (response_texts, records, finished: one element per sample) and returns one float per sample."""
    def mark(fn: RewardFn) -> RewardFn:
        setattr(fn, MARK, VerifierEntry(fn, needs_answer, isolated, batched))
        return fn
    return mark


def register_verifier(name: str, *, needs_answer: bool = False, isolated: bool = False, batched: bool = False):
    """Decorator: register `fn` as reward.fn=`name` (with what `verifier` says it needs)."""
    def add(fn: RewardFn) -> RewardFn:
        VERIFIERS.register(name, VerifierEntry(fn, needs_answer, isolated, batched))
        return fn
    return add


def from_import(obj, value: str) -> VerifierEntry:
    """The entry of reward.fn=`value` naming `obj`: a function (what `@verifier` said it needs;
    unmarked: no answer, in this process) or a VerifierEntry. ExtensionError says what is wrong."""
    entry = obj if isinstance(obj, VerifierEntry) else getattr(obj, MARK, None)
    if entry is None:
        entry = VerifierEntry(obj, needs_answer=False, isolated=False)
    if not callable(entry.fn) or isinstance(entry.fn, type):
        raise ExtensionError(f"is {a(entry.fn)}, not a function: name a function "
                             f"fn(response_text, record, *, finished) -> float")
    _check_signature(entry)
    if entry.isolated and entry.is_async:
        raise ExtensionError("is an async function marked isolated: a worker process runs plain functions; "
                             "drop isolated=True (it is awaited on the reward runner's loop, within "
                             "reward.timeout_s) or make it a plain def")
    if entry.isolated:
        try:
            pickle.dumps(entry.fn)
        except Exception as err:   # noqa: BLE001 - a lambda, a nested function, a bound method...
            raise ExtensionError(f"is isolated (runs in a worker process), so it must be a module-level function "
                                 f"(it travels pickled by name): {err}") from None
    return entry


def _check_signature(entry: VerifierEntry) -> None:
    """The verifier can be called as the rollout calls it (megarl.rewards.verify.Verifier)."""
    many = "s" if entry.batched else ""
    finished = [False] if entry.batched else False
    kwargs = {"finished": finished, **({"answer_key": "answer"} if entry.needs_answer else {})}
    call = (f"fn(response_text{many}, record{many}, *, finished"
            + (", answer_key)" if entry.needs_answer else ")"))
    check_call(entry.fn, (["response_text"], [{}]) if entry.batched else ("response_text", {}), kwargs, call)
