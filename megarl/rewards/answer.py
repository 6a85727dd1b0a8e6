"""Final answers in responses: where they are, how they compare; the `exact` and `format` verifiers.

A response states its final answer as `\\boxed{...}` (the last one counts; braces may nest) or,
failing that, on a line `answer: ...` (any case, the last such line counts; "Final answer: 7"
matches too). Both are pure string work (regex without backtracking blow-ups), so they run in
the trainer process (megarl.rewards.verify).
"""
from __future__ import annotations

import re

from megarl.rewards.entry import register_verifier

_ANSWER_LINE = re.compile(r"answer\s*:\s*(.*)", re.IGNORECASE)
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (brace-balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None   # unclosed: the response was cut inside its answer


def extract_answer(text: str) -> str | None:
    """The response's final answer (see the module doc), or None when it states none."""
    boxed = last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    lines = [m.group(1).strip() for m in _ANSWER_LINE.finditer(text)]
    lines = [line for line in lines if line]
    return lines[-1] if lines else None


def normalize(answer: str) -> str:
    """Casefolded, `$` and a trailing period dropped, whitespace collapsed, thousands separators
    removed ("1,000" == "1000"), so formatting alone never decides a match."""
    s = str(answer).strip().rstrip(".").strip().strip("$").strip().rstrip(".").strip()
    s = _THOUSANDS.sub("", s)
    return " ".join(s.split()).casefold()


@register_verifier("exact", needs_answer=True)
def exact_score(response_text: str, record: dict, *, finished: bool, answer_key: str = "answer") -> float:
    """1.0 when the final answer (or, with no marker, the whole response) equals the gold
    `record[answer_key]` after normalize(), else 0.0."""
    got = extract_answer(response_text)
    if got is None:
        got = response_text
    got = normalize(got)
    return float(bool(got) and got == normalize(record[answer_key]))


@register_verifier("format")
def format_score(response_text: str, record: dict, *, finished: bool) -> float:
    """1.0 when the response states a final answer as `\\boxed{...}` or `answer: ...`, else 0.0
    (a format reward: it looks at no gold answer)."""
    return float(extract_answer(response_text) is not None)
