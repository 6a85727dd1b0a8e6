"""The answer a response states, for verifiers whose answers can be compared (maj@n).

An extractor maps (response text, finished) to a comparable answer string, or None when the
response states none. Built-in verifiers: `math` and `exact` compare the final answer
(`\\boxed{...}` or `answer: ...`, normalised: megarl/rewards/answer.py); `countdown` the words
up to the end of the sequence, which is its whole answer (and whether it ended: its reward
tells an unfinished answer apart). A verifier outside megarl opts in with an attribute on its
function, `fn.extract_answer = callable(text, finished) -> str | None`. Others (`format`,
`none`) report no maj@n: their rewards do not come from comparing an answer.
"""
from __future__ import annotations

from typing import Callable, Optional

from megarl.data.countdown import EOS_TOKEN
from megarl.rewards import verifier_entry
from megarl.rewards.answer import extract_answer, normalize
from megarl.rewards.countdown import response_words

Extractor = Callable[[str, bool], Optional[str]]


def final_answer(text: str, finished: bool) -> Optional[str]:
    """math / exact: the stated final answer, normalised (None: it states none)."""
    got = extract_answer(text)
    return None if got is None else normalize(got)


def countdown_answer(text: str, finished: bool) -> Optional[str]:
    """countdown: the words up to <eos>, with the <eos> when the response ended on it (what its
    verifier compares with the target)."""
    words = response_words(text, finished)
    if words in ([], [EOS_TOKEN]):   # no word before the end: no answer stated
        return None
    return " ".join(words)


BUILT_IN: dict[str, Extractor] = {"math": final_answer, "exact": final_answer, "countdown": countdown_answer}


def extractor_of(verifier: str) -> Optional[Extractor]:
    """The answer extractor of verifier `verifier` (a name or an import path), or None."""
    if verifier in BUILT_IN:
        return BUILT_IN[verifier]
    return getattr(verifier_entry(verifier).fn, "extract_answer", None)
