"""Reward-model scoring on the trainer ranks: each sequence's score is the value at its last
token (what transformers' sequence classifiers pool). The model is built by
`megarl.models.reward.build_reward_model`.
"""
from __future__ import annotations

import torch

from megarl.distributed.parallel import dp_rows
from megarl.models.offload import resident
from megarl.ppo.batch import Batch
from megarl.ppo.schedule import forward_per_token, gather_dp


def _last_token_scores(batch: Batch, out: torch.Tensor) -> torch.Tensor:
    """out [b, L, 1] -> [b, R] holding each row's score in column 0 (shape of forward_per_token)."""
    lengths = batch.resp_mask.sum(dim=1).long()
    rows = torch.arange(batch.size, device=batch.device)
    last_pos = batch.resp_index[rows, (lengths - 1).clamp(min=0)] + 1
    scores = out[rows, last_pos.clamp(max=out.shape[1] - 1), 0].float()
    result = torch.zeros_like(batch.resp_mask)
    result[:, 0] = scores
    return result


def sequence_scores(model, batch: Batch, micro_batch_size: int) -> torch.Tensor:
    """[B] reward-model score of each sequence (prompt + response). Collective over all ranks;
    each DP rank scores its rows, and every rank gets all of them."""
    local = batch.select(dp_rows(batch.size))
    with resident(model):
        out = forward_per_token(model, local, micro_batch_size, lambda mb, o: _last_token_scores(mb["batch"], o))
    return gather_dp(out)[:, 0]
