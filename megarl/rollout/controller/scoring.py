"""A sample's reward from the run's verifier: both rollout modes score through here."""
from __future__ import annotations

from typing import Callable

from megarl.data.sample import Sample


def score_sample(sample: Sample, tokenizer, reward_fn: Callable) -> float:
    """The verifier's reward of `sample`: its response decoded without special tokens, and
    whether the engine stopped on EOS (the verifier's `finished`, not the token budget)."""
    text = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    return float(reward_fn(text, sample.record, finished=sample.stopped))
