"""Reward-model scoring on the trainer ranks: each sequence's score is the value at its last
token (what transformers' sequence classifiers pool). The model is built by
`megarl.models.reward.build_reward_model`.
"""
from __future__ import annotations

from typing import Callable

import torch

from megarl.ppo.advantages import last_index
from megarl.ppo.batch import Batch
from megarl.ppo.schedule import forward_per_token
from megarl.ppo.step import Pass


def _last_token_scores(batch: Batch, out: torch.Tensor) -> torch.Tensor:
    """out [b, L, 1] -> [b, R] holding each row's score in column 0 (shape of forward_per_token)."""
    rows = torch.arange(batch.size, device=batch.device)
    last_pos = batch.resp_index[rows, last_index(batch.resp_mask)] + 1
    scores = out[rows, last_pos.clamp(max=out.shape[1] - 1), 0].float()
    result = torch.zeros_like(batch.resp_mask)
    result[:, 0] = scores
    return result


def _scores(model, batch: Batch, micro_batch_size: int) -> torch.Tensor:
    return forward_per_token(model, batch, micro_batch_size, lambda mb, o: _last_token_scores(mb["batch"], o))


def score_pass(model) -> Pass:
    """The reward model's pass ([b, R], the score in column 0); frozen: its values do not
    change with the trained weights (the intra-step overlap keeps them across updates)."""
    return Pass("rm", model, _scores, resident=model, versioned=False)


def sequence_scores(model, batch: Batch, micro_batch_size: int,
                    forward: Callable[[Pass], torch.Tensor] | None = None) -> torch.Tensor:
    """[B] reward-model score of each sequence (prompt + response). Collective over all ranks;
    each DP rank scores its rows, and every rank gets all of them. `forward`: as in
    `ppo.step.ppo_step` (rollout.overlap: rows scored during the round are taken as they are)."""
    p = score_pass(model)
    return (forward or (lambda q: q.run(batch, micro_batch_size)))(p)[:, 0]
