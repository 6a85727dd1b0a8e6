"""Verifiable reward for the countdown task (megarl.data.countdown), computed on word strings.

The target is the answer's words followed by eos, i.e. N + 1 tokens; eos counts as a token
(``finished=True`` means the policy emitted it). With ``resp`` = the response's words plus
eos when finished:

    score = 1.0                                                 if resp == target
          = common_prefix(resp, target) / max(N + 1, len(resp)) otherwise

So the exact answer without eos (truncated, or ran on) scores N / (N + 1) < 1, partial answers
get prefix credit, and over-long responses are penalised through the denominator.
Examples (N = 5, target "n5 n4 n3 n2 n1 <eos>"):
    "n5 n4 n3 n2 n1", finished        -> 1.0
    "n5 n4 n3 n2 n1", not finished    -> 5/6
    "n5 n3 n1" (count by 2), finished -> 1/6   (only "n5" matches)
    "n5 n4 n3 n2 n1 n0 n0 n0", finished -> 5/9 (prefix 5, length 8 + eos)
"""

from __future__ import annotations

from megarl.data.countdown import EOS_TOKEN
from megarl.rewards.entry import register_verifier


def response_words(response_text: str, finished: bool) -> list[str]:
    """The response as the verifier reads it: its words up to a literal "<eos>" word (which
    ends it, as if finished), followed by eos when it finished."""
    words = response_text.split()
    if EOS_TOKEN in words:
        words = words[: words.index(EOS_TOKEN)]
        finished = True
    return words + ([EOS_TOKEN] if finished else [])


@register_verifier("countdown")
def countdown_score(response_text: str, record: dict, *, finished: bool) -> float:
    """Reward in [0, 1] for one response.

    Args:
        response_text: generated text decoded with ``skip_special_tokens=True`` (words split on
            whitespace). A literal ``"<eos>"`` word, if present, is treated as the end of the
            response (as if finished) and anything after it is ignored.
        record: a countdown record; only ``record["answer"]`` (without eos) is used.
        finished: True when the model emitted eos (vs. hit the length limit / was cut).
    """
    target = record["answer"].split() + [EOS_TOKEN]
    resp = response_words(response_text, finished)
    if resp == target:
        return 1.0
    prefix = 0
    for a, b in zip(resp, target):
        if a != b:
            break
        prefix += 1
    return prefix / max(len(target), len(resp))
