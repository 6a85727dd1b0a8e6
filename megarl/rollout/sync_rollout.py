"""Synchronous rollout: generate every sample of the step, then score them.

The baseline the partial-rollout controller is measured against: the step waits for its
longest response. It runs on the same engine pool and protocol as the controller.
"""
from __future__ import annotations

from typing import Callable

from megarl.data.prompts import prompt_text
from megarl.rollout.engine import GenRequest
from megarl.rollout.types import Sample


def encode_prompts(tokenizer, records: list[dict], key: str, messages_key: str = "messages") -> list[list[int]]:
    """Token ids of each record's prompt: the text field `key`, or the chat `messages_key`
    rendered with the tokenizer's chat template (megarl.data.prompts.prompt_text). No special
    tokens are added: prompts and chat templates carry their own."""
    return [tokenizer(prompt_text(r, tokenizer, key, messages_key), add_special_tokens=False)["input_ids"]
            for r in records]


def score(sample: Sample, tokenizer, reward_fn: Callable) -> float:
    text = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    return float(reward_fn(text, sample.record, finished=sample.finished))


def sample_seeds(run_seed: int, step: int, count: int) -> list[int]:
    """Per-prompt sampling seeds that depend only on (run seed, step, position)."""
    return [(run_seed * 1_000_003 + step * 10_007 + i) % (2**31 - 1) for i in range(count)]


def group_requests(prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float,
                   seeds: list[int] | None, tag: str = "") -> list[GenRequest]:
    """n requests per prompt, in group order. Sample j of prompt i is drawn from its own
    generator seeded seeds[i] * 1000 + j, so a run is reproducible from its seed whatever the
    engines did before (e.g. after a resume) and whichever engine serves it."""
    return [GenRequest(f"{tag}g{i}s{j}", p, max_new_tokens, temperature,
                       seed=None if seeds is None else seeds[i] * 1000 + j)
            for i, p in enumerate(prompts) for j in range(n)]


def generate_groups(pool, records: list[dict], prompts: list[list[int]], n: int,
                    max_new_tokens: int, tokenizer, reward_fn: Callable,
                    seeds: list[int] | None = None, temperature: float = 1.0,
                    tag: str = "", first_uid: int = 0) -> list[Sample]:
    """n samples per prompt from the engine pool (a SyncPool), scored, in group order
    (group g = records[g], uid first_uid + g). Token versions are the ones
    the engines reported."""
    results = pool.generate_many(group_requests(prompts, n, max_new_tokens, temperature, seeds, tag))
    samples = []
    for k, r in enumerate(results):
        g = k // n
        s = Sample(prompts[g], r.token_ids, r.logprobs, r.versions, r.finished, g, records[g],
                   finish_reason=r.finish_reason, uid=first_uid + g)
        s.reward = score(s, tokenizer, reward_fn)
        samples.append(s)
    return samples
