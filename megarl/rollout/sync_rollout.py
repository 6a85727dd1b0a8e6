"""Synchronous rollout: generate every sample of the step, then score them.

The baseline the partial-rollout controller is measured against: the step waits for its
longest response. It runs on the same engine pool and protocol as the controller.
"""
from __future__ import annotations

from typing import Callable

from megarl.data.sample import Sample
from megarl.data.seeds import sample_seed
from megarl.rollout.engine import GenRequest
from megarl.rollout.scoring import score_sample


def group_requests(prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float,
                   seeds: list[int] | None, tag: str = "") -> list[GenRequest]:
    """n requests per prompt, in group order. Sample j of prompt i is drawn from its own
    generator seeded seeds.sample_seed(seeds[i], j), so a run is reproducible from its seed
    whatever the engines did before (e.g. after a resume) and whichever engine serves it."""
    return [GenRequest(f"{tag}g{i}s{j}", p, max_new_tokens, temperature,
                       seed=None if seeds is None else sample_seed(seeds[i], j))
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
        s = Sample(prompts[g], r.token_ids, r.logprobs, r.versions, r.stopped, g, records[g],
                   finish_reason=r.finish_reason, uid=first_uid + g)
        s.reward = score_sample(s, tokenizer, reward_fn)
        samples.append(s)
    return samples
