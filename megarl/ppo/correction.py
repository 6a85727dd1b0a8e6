"""Behaviour-policy correction: importance weights from the engine's logprobs to the trainer's.

The engine (vLLM) sampled each token under the behaviour policy mu (a possibly older version,
with different numerics); the PPO ratio is taken against the trainer's old policy. The weight
w = pi_old / mu = exp(old_logp - behav_logp) corrects for both staleness and the train/infer
mismatch. See docs/design.md, "Off-policy correction".
"""

import torch
from torch import Tensor

from megarl.config.registry import IS_LEVELS, IS_MODES
from megarl.ppo.losses import LOG_RATIO_CLAMP, masked_mean


@torch.no_grad()  # weights scale the loss; gradients must not flow through them
def behaviour_weights(
    old_logp: Tensor,
    behav_logp: Tensor,
    mask: Tensor,
    mode: str,
    level: str,
    cap: float,
    low: float,
    high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance weights pi_old / mu for the policy loss.

    Args:
        old_logp: [B, T] trainer logprobs under the step's starting weights.
        behav_logp: [B, T] engine logprobs of the same tokens.
        mask: [B, T] 1 on response tokens.
        mode: an IS_MODES entry (algo.is_mode): "tis" min(w, cap) (truncated IS); "mask"
            weight 1 where low <= w <= high, else 0 (token or sequence dropped); "none" weight 1.
        level: an IS_LEVELS entry (algo.is_level): "token" w per token; "sequence" exp(sum of
            masked log-ratios), one weight per row; "geo_sequence" exp(mean of masked
            log-ratios), the geometric mean, which does not explode with length. Sequence
            weights are broadcast to the row's tokens.
        cap: TIS truncation (mode "tis"); low, high: kept range (mode "mask").

    Returns:
        (weights [B, T], 0 where mask is 0; stats) with detached 0-d tensors: is_weight_mean and
        is_weight_max of the raw w over masked tokens (before truncation/masking, so they show
        the mismatch itself), and is_masked_frac (masked tokens whose weight is 0).
    """
    weigh, pool = IS_MODES.get(mode), IS_LEVELS.get(level)
    # where, not multiply: padded logprobs may be inf/nan and inf * 0 is nan.
    log_w = pool(torch.where(mask.bool(), old_logp - behav_logp, 0.0), mask)
    raw = torch.exp(torch.clamp(log_w, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weights = weigh(raw, cap, low, high) * mask
    stats = {
        "is_weight_mean": masked_mean(raw, mask),
        "is_weight_max": torch.where(mask.bool(), raw, 0.0).max(),
        "is_masked_frac": masked_mean((weights == 0).to(raw.dtype), mask),
    }
    return weights, stats


@IS_LEVELS.register("token")
def _per_token(log_w: Tensor, mask: Tensor) -> Tensor:
    return log_w


@IS_LEVELS.register("sequence")
def _per_sequence(log_w: Tensor, mask: Tensor) -> Tensor:
    return log_w.sum(dim=-1, keepdim=True).expand_as(mask)


@IS_LEVELS.register("geo_sequence")
def _per_sequence_geometric(log_w: Tensor, mask: Tensor) -> Tensor:
    return masked_mean(log_w, mask, dim=-1).unsqueeze(-1).expand_as(mask)


@IS_MODES.register("tis")
def _truncate(raw: Tensor, cap: float, low: float, high: float) -> Tensor:
    return torch.clamp(raw, max=cap)


@IS_MODES.register("mask")
def _mask_outside(raw: Tensor, cap: float, low: float, high: float) -> Tensor:
    return ((raw >= low) & (raw <= high)).to(raw.dtype)


@IS_MODES.register("none")
def _uncorrected(raw: Tensor, cap: float, low: float, high: float) -> Tensor:
    return torch.ones_like(raw)


#: token ages (trained step - version that generated the token) with a metric of their own;
#: older tokens share the last bucket
MASKED_AGES = (0, 1, 2)


@torch.no_grad()
def masked_frac_by_age(weights: Tensor, mask: Tensor, versions: Tensor, step: int) -> dict[str, Tensor]:
    """is_masked_frac split by token age: is_masked_frac_age0 / _age1 / _age2plus, the share of
    the tokens of that age whose weight is 0 (0 when there are none). Age 0 measures only the
    train/inference mismatch; in async mode (rollout.partial.async) tokens generated between pending()
    and the push carry one version of policy drift too, and show in the older buckets.

    Args:
        weights, mask: [B, T] as behaviour_weights returns them and takes them.
        versions: [B, T] version that generated each token; step: the trained version.
    """
    age = step - versions.to(mask.device)
    masked = (weights == 0).to(mask.dtype)
    out = {}
    for i, a in enumerate(MASKED_AGES):
        last = i == len(MASKED_AGES) - 1
        sel = mask * ((age >= a) if last else (age == a)).to(mask.dtype)
        out[f"is_masked_frac_age{a}{'plus' if last else ''}"] = masked_mean(masked, sel)
    return out


@torch.no_grad()
def mismatch_stats(trainer_logp: Tensor, engine_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Train/infer logprob mismatch over masked tokens, as detached 0-d tensors.

    Args:
        trainer_logp, engine_logp, mask: [B, T].

    Returns:
        logprob_mismatch_mean (mean |a - b|), logprob_mismatch_max, logprob_mismatch_exp
        (exp of the mean, a multiplicative "typical ratio" that reads like an IS weight).
    """
    # where, not multiply: padded logprobs may be inf/nan and inf * 0 is nan.
    diff = torch.where(mask.bool(), (trainer_logp - engine_logp).abs(), 0.0)
    mean = masked_mean(diff, mask)
    return {
        "logprob_mismatch_mean": mean,
        "logprob_mismatch_max": diff.max(),
        "logprob_mismatch_exp": torch.exp(mean),
    }
