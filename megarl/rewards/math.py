"""The `math` verifier: the gold answer and the response compared as mathematics by math-verify
("1/2", "0.5" and "\\frac{1}{2}" are equal; so are "x^2+1" and "1+x^2").

math-verify parses LaTeX and expressions with sympy, which can take unbounded time on
adversarial model output; megarl.rewards.verify therefore runs this function in a worker
process it can kill. math-verify's own signal-based timeouts are off here for the same reason
(one hard limit, reward.timeout_s, and every timeout is counted), and its raise_on_error stays
off: a response that does not parse is a wrong answer (0), not a verifier error.
"""
from __future__ import annotations

import logging
from functools import lru_cache

from megarl.rewards.entry import register_verifier

# math-verify warns "timeout disabled" on every call: ours is outside it (see above)
logging.getLogger("math_verify").setLevel(logging.ERROR)


def _parse(text: str):
    # here, not at the top: importing it takes seconds (sympy); only a process that scores math pays
    from math_verify import parse
    return parse(text, parsing_timeout=None)


@lru_cache(maxsize=1024)   # the n samples of a group share their gold answer: parse it once
def _parse_gold_text(text: str) -> tuple:
    parsed = _parse(text) if ("$" in text or "\\boxed" in text) else []
    return tuple(parsed or _parse(f"${text}$"))


def parse_gold(answer) -> list:
    """The gold answer parsed; a bare answer ("x^2+1") is read as LaTeX math (wrapped in $...$)."""
    return list(_parse_gold_text(str(answer).strip()))


@register_verifier("math", needs_answer=True, isolated=True)
def math_score(response_text: str, record: dict, *, finished: bool, answer_key: str = "answer") -> float:
    """1.0 when the response's answer equals the gold `record[answer_key]` mathematically, else 0.0.
    A gold answer that does not parse raises (counted as reward_errors: a data problem)."""
    from math_verify import verify  # here, not at the top: as in _parse
    gold = parse_gold(record[answer_key])
    if not gold:
        raise ValueError(f"gold answer {record[answer_key]!r} (data.answer_key={answer_key!r}) does not parse")
    pred = _parse(response_text)
    return float(bool(pred) and verify(gold, pred, timeout_seconds=None))
