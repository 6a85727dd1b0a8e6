"""Synchronous rollout: generate every sample of the step, then score them.

The baseline the partial-rollout controller is measured against: the step waits for its
longest response.
"""
from __future__ import annotations

from typing import Callable

from megarl.rollout.types import Sample
from megarl.rollout.vllm_engine import VLLMEngine


def encode_prompts(tokenizer, records: list[dict], key: str) -> list[list[int]]:
    return [tokenizer(r[key], add_special_tokens=False)["input_ids"] for r in records]


def score(sample: Sample, tokenizer, reward_fn: Callable) -> float:
    text = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    return float(reward_fn(text, sample.record, finished=sample.finished))


def sample_seeds(run_seed: int, step: int, count: int) -> list[int]:
    """Per-prompt sampling seeds that depend only on (run seed, step, position)."""
    return [(run_seed * 1_000_003 + step * 10_007 + i) % (2**31 - 1) for i in range(count)]


def generate_groups(engine: VLLMEngine, records: list[dict], prompts: list[list[int]], n: int,
                    max_new_tokens: int, tokenizer, reward_fn: Callable,
                    seeds: list[int] | None = None) -> list[Sample]:
    """n samples per prompt, scored, in group order (group g = records[g])."""
    samples = []
    outs = engine.generate(prompts, n, max_new_tokens, seeds)
    for g, (rec, prompt, group) in enumerate(zip(records, prompts, outs)):
        for c in group:
            s = Sample(prompt, c.token_ids, c.logprobs, [engine.version] * len(c.token_ids),
                       c.finished, g, rec)
            s.reward = score(s, tokenizer, reward_fn)
            samples.append(s)
    return samples
