"""Per-token loss -> scalar, independent of how the global batch is split.

The caller computes the normaliser once for the GLOBAL batch (`global_normalizer` on each
rank's local mask, then all-reduce SUM over DP and over microbatches) and passes it to every
`aggregate` call. Every mode is then a sum of per-token or per-sequence terms divided by one
constant, so summing `aggregate` over any partition of the batch into microbatches and ranks
equals aggregating the whole batch at once. If the data-parallel gradient reduction averages
over ranks (Megatron's default), multiply the loss by the DP world size to undo it.
"""

from torch import Tensor

from megarl.ppo.losses import masked_sum

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def _check_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; allowed: {', '.join(AGG_MODES)}")


def global_normalizer(mask: Tensor, mode: str) -> float:
    """This rank's share of the normaliser for `mode`; all-reduce SUM it across the batch.

    Args:
        mask: [B, T] 1 on response tokens.

    Returns:
        token-mean: number of valid tokens; seq-*: number of rows with at least one valid
        token (fully padded rows, e.g. microbatch filler, do not count as sequences).
    """
    _check_mode(mode)
    if mode == "token-mean":
        return float(mask.sum())
    return float((mask.sum(dim=-1) > 0).sum())


def aggregate(per_token_loss: Tensor, mask: Tensor, mode: str, normalizer: float) -> Tensor:
    """Scalar loss for one microbatch, scaled by the global-batch normaliser.

    Args:
        per_token_loss, mask: [B, T].
        mode: "token-mean" sum(loss * mask) / normalizer (every token weighs the same);
            "seq-mean-token-mean" sum over rows of the row's token mean / normalizer (every
            sequence weighs the same); "seq-mean-token-sum" sum over rows of the row's token
            sum / normalizer (Dr. GRPO: long sequences weigh more, no length bias per token).
        normalizer: the GLOBAL `global_normalizer` for mode (all-reduced), > 0.

    Returns:
        0-d tensor. Summing it over microbatches with the same normaliser equals aggregating
        the whole batch at once.
    """
    _check_mode(mode)
    if normalizer <= 0:
        raise ValueError(
            f"normalizer must be > 0, got {normalizer}; pass the all-reduced "
            f"global_normalizer(mask, {mode!r}) of a batch with at least one valid token"
        )
    if mode == "token-mean":
        return masked_sum(per_token_loss, mask) / normalizer
    per_seq = masked_sum(per_token_loss, mask, dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(dim=-1).clamp_min(1)
    return per_seq.sum() / normalizer
