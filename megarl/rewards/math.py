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


def _parse(text: str):
    from math_verify import parse
    return parse(text, parsing_timeout=None)


def parse_gold(answer) -> list:
    """The gold answer parsed; a bare answer ("x^2+1") is read as LaTeX math (wrapped in $...$)."""
    text = str(answer).strip()
    parsed = _parse(text) if ("$" in text or "\\boxed" in text) else []
    return parsed or _parse(f"${text}$")


def math_score(response_text: str, record: dict, *, finished: bool, answer_key: str = "answer") -> float:
    """1.0 when the response's answer equals the gold `record[answer_key]` mathematically, else 0.0.
    A gold answer that does not parse raises (counted as reward_errors: a data problem)."""
    from math_verify import verify
    logging.getLogger("math_verify").setLevel(logging.ERROR)   # "timeout disabled" warnings: ours is outside
    gold = parse_gold(record[answer_key])
    if not gold:
        raise ValueError(f"gold answer {record[answer_key]!r} (data.answer_key={answer_key!r}) does not parse")
    pred = _parse(response_text)
    return float(bool(pred) and verify(gold, pred, timeout_seconds=None))
