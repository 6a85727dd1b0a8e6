"""Samples' rewards from the run's verifier (a megarl.rewards.RewardRunner, any kind of
verifier): every rollout mode and the evaluation score through here. A group is scored as one
unit (a batched verifier sees whole groups); a refused sample scores 0 without the verifier (it
has no response: the environment contract's failed sample).
"""
from __future__ import annotations

import asyncio
import itertools

from megarl.data.sample import Sample

REFUSED = "refused"        # finish_reason of a sample the engine refused as invalid


def verifier_inputs(samples: list[Sample], tokenizer) -> tuple[list[str], list[dict], list[bool]]:
    """What the verifier reads of each sample: its response decoded without special tokens, its
    record, and whether the engine stopped on EOS (`finished`, not the token budget)."""
    return ([tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples],
            [s.record for s in samples], [s.stopped for s in samples])


def each_sample(reward, texts: list[str], records: list[dict], finished: list[bool]) -> list[float]:
    """A group's scores from a plain per-sample function `reward(text, record, finished=...)`,
    called in order on the calling thread: what Rollout's signature (`reward_fn: Callable`)
    accepts besides the run's RewardRunner (megarl.rewards.runner); train.py always gives the
    runner, the controller's unit tests a plain function."""
    return [float(reward(t, r, finished=f)) for t, r, f in zip(texts, records, finished)]


def score_all(samples: list[Sample], tokenizer, reward) -> list[Sample]:
    """Each sample's reward (set on it), blocking: consecutive samples of one group are scored
    together, every group submitted at once (scored concurrently, up to reward.concurrency).
    `reward`: a RewardRunner, or a plain per-sample function (each_sample)."""
    live = [s for s in samples if s.finish_reason != REFUSED]
    groups = [list(g) for _, g in itertools.groupby(live, key=lambda s: s.group)]
    for s in samples:
        s.reward = 0.0
    inputs = [verifier_inputs(g, tokenizer) for g in groups]
    scored = (reward.score_groups(inputs) if hasattr(reward, "score_groups")
              else [each_sample(reward, *i) for i in inputs])
    for group, scores in zip(groups, scored):
        for s, value in zip(group, scores):
            s.reward = value
    return samples


async def score_group(samples: list[Sample], tokenizer, reward) -> list[float]:
    """The group's rewards, awaited on the engines' loop while the decoding and the verifier run
    off it (a worker thread, then the reward runner): the loop serves requests meanwhile."""
    live = [i for i, s in enumerate(samples) if s.finish_reason != REFUSED]
    inputs = await asyncio.to_thread(verifier_inputs, [samples[i] for i in live], tokenizer)
    if hasattr(reward, "submit"):
        scores = await asyncio.wrap_future(reward.submit(*inputs))
    else:   # a plain per-sample function: off the loop too
        scores = await asyncio.to_thread(each_sample, reward, *inputs)
    out = [0.0] * len(samples)
    for i, value in zip(live, scores):
        out[i] = value
    return out
