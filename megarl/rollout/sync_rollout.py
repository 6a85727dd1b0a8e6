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


async def generate_groups(pool, records: list[dict], prompts: list[list[int]], n: int,
                          max_new_tokens: int, seeds: list[int] | None = None, temperature: float = 1.0,
                          tag: str = "", first_uid: int = 0) -> list[Sample]:
    """n samples per prompt from the engine pool (an EnginePool, on its loop), unscored, in
    group order (group g = records[g], uid first_uid + g). Token versions are the ones the
    engines reported."""
    results = await pool.generate_all(group_requests(prompts, n, max_new_tokens, temperature, seeds, tag))
    return [Sample(prompts[k // n], r.token_ids, r.logprobs, r.versions, r.stopped, k // n, records[k // n],
                   finish_reason=r.finish_reason, uid=first_uid + k // n) for k, r in enumerate(results)]


def score_all(samples: list[Sample], tokenizer, reward_fn: Callable) -> list[Sample]:
    """Each sample's reward from the run's verifier, one after another (off the pool's loop)."""
    for s in samples:
        s.reward = score_sample(s, tokenizer, reward_fn)
    return samples
