"""Per-token loss -> scalar, independent of how the global batch is split.

The caller computes the normaliser once for the GLOBAL batch (`global_normalizer` on each
rank's local mask, then all-reduce SUM over DP and over microbatches) and passes it to every
`aggregate` call. Every mode is then a sum of per-token or per-sequence terms divided by one
constant, so summing `aggregate` over any partition of the batch into microbatches and ranks
equals aggregating the whole batch at once. If the data-parallel gradient reduction averages
over ranks (Megatron's default), multiply the loss by the DP world size to undo it.

Names follow verl's `loss_agg_mode`. Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like
Training") is "seq-mean-token-sum-norm": token sums divided by a constant, the generation budget
(rollout.sampling.max_new_tokens), so no length enters the normaliser. verl divides each micro-batch by
that constant only; here it is also divided by the number of sequences (the paper's 1/G), which
keeps the result independent of the split and its scale that of a per-token mean over full-budget
responses.
"""

from dataclasses import dataclass
from typing import Callable, Optional

from torch import Tensor

from megarl.config.registry import LOSS_AGGS
from megarl.ppo.losses import masked_sum


@dataclass(frozen=True)
class Aggregation:
    """One algo.loss_agg mode: `normalizer(mask, max_len)` is this rank's share of the divisor,
    `total(per_token_loss, mask)` the sum of the per-token or per-sequence terms it divides."""
    normalizer: Callable[[Tensor, Optional[int]], float]
    total: Callable[[Tensor, Tensor], Tensor]


def _tokens(mask: Tensor, max_len: Optional[int]) -> float:
    return float(mask.sum())


def _sequences(mask: Tensor, max_len: Optional[int]) -> float:
    return float((mask.sum(dim=-1) > 0).sum())


def _sequences_times_budget(mask: Tensor, max_len: Optional[int]) -> float:
    mode = "seq-mean-token-sum-norm"
    if max_len is None:
        raise ValueError(
            f"loss aggregation {mode!r} divides by a constant budget: pass "
            f"max_len=rollout.sampling.max_new_tokens to global_normalizer"
        )
    longest = int(mask.sum(dim=-1).max()) if mask.numel() else 0
    if max_len < max(longest, 1):
        raise ValueError(
            f"max_len={max_len} is below a response of {longest} tokens; {mode!r} needs the "
            f"generation budget rollout.sampling.max_new_tokens, which bounds every response"
        )
    return _sequences(mask, max_len) * max_len


def _token_sum(per_token_loss: Tensor, mask: Tensor) -> Tensor:
    return masked_sum(per_token_loss, mask)


def _sum_of_row_means(per_token_loss: Tensor, mask: Tensor) -> Tensor:
    per_seq = masked_sum(per_token_loss, mask, dim=-1) / mask.sum(dim=-1).clamp_min(1)
    return per_seq.sum()


def _sum_of_row_sums(per_token_loss: Tensor, mask: Tensor) -> Tensor:
    return masked_sum(per_token_loss, mask, dim=-1).sum()


LOSS_AGGS.register("token-mean", Aggregation(_tokens, _token_sum))
LOSS_AGGS.register("seq-mean-token-mean", Aggregation(_sequences, _sum_of_row_means))
LOSS_AGGS.register("seq-mean-token-sum", Aggregation(_sequences, _sum_of_row_sums))
LOSS_AGGS.register("seq-mean-token-sum-norm", Aggregation(_sequences_times_budget, _sum_of_row_sums))


def global_normalizer(mask: Tensor, mode: str, max_len: Optional[int] = None) -> float:
    """This rank's share of the normaliser for `mode`; all-reduce SUM it across the batch.

    Args:
        mask: [B, T] 1 on response tokens.
        max_len: the generation budget in tokens (rollout.sampling.max_new_tokens); required by
            seq-mean-token-sum-norm, ignored by the other modes.

    Returns:
        token-mean: number of valid tokens; seq-mean-token-mean and seq-mean-token-sum: number
        of sequences, i.e. rows with at least one valid token (fully padded rows, e.g.
        microbatch filler, do not count); seq-mean-token-sum-norm: sequences * max_len.
    """
    return LOSS_AGGS.get(mode).normalizer(mask, max_len)


def aggregate(per_token_loss: Tensor, mask: Tensor, mode: str, normalizer: float) -> Tensor:
    """Scalar loss for one microbatch, scaled by the global-batch normaliser.

    Args:
        per_token_loss, mask: [B, T].
        mode: "token-mean" sum(loss * mask) / normalizer (every token weighs the same);
            "seq-mean-token-mean" sum over rows of the row's token mean / normalizer (every
            sequence weighs the same); "seq-mean-token-sum" sum over rows of the row's token
            sum / normalizer (every token weighs the same within a batch, but the divisor is
            the number of sequences, so the scale grows with response length);
            "seq-mean-token-sum-norm" the same sum / (sequences * generation budget) (Dr.
            GRPO: every token weighs the same, with a divisor that does not depend on lengths).
        normalizer: the GLOBAL `global_normalizer` for mode (all-reduced), > 0.

    Returns:
        0-d tensor. Summing it over microbatches with the same normaliser equals aggregating
        the whole batch at once.
    """
    agg = LOSS_AGGS.get(mode)
    if normalizer <= 0:
        raise ValueError(
            f"normalizer must be > 0, got {normalizer}; pass the all-reduced "
            f"global_normalizer(mask, {mode!r}) of a batch with at least one valid token"
        )
    return agg.total(per_token_loss, mask) / normalizer
