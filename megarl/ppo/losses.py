"""Per-token PPO losses, KL penalties and entropy.

Every loss here returns a per-token [B, T] tensor, zero where mask is 0; aggregation to a
scalar is `megarl.ppo.aggregate`'s job, so it can use the global-batch normaliser. The policy
losses (algo.policy_loss: `ppo`, `gspo`, `cispo`, docs/algorithms.md) are POLICY_LOSSES entries
with one signature, `fn(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip,
is_weights) -> (per_token_loss, stats)`; a loss is minimised (its value is minus the objective). Stats are
detached 0-d tensors (not python floats) so a training step never waits on a device-to-host
copy per microbatch and the caller can all-reduce them.
"""

import torch
from torch import Tensor

from megarl.config.registry import KL_KINDS, POLICY_LOSSES

# exp(20) ~ 5e8 is beyond any clip or cap, yet far from float overflow: garbage logprobs at
# padded positions or a wildly stale token cannot make inf, and inf * 0 (mask) = nan.
LOG_RATIO_CLAMP = 20.0
# One far-off-policy token would otherwise dominate a k3 penalty; verl clamps at the same value.
K3_CLAMP = 10.0


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of x where mask is 1. x, mask: same shape; dim None sums everything."""
    return (x * mask).sum() if dim is None else (x * mask).sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x where mask is 1; 0 (not nan) where the mask is empty."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1)


@POLICY_LOSSES.register("ppo")
def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped PPO surrogate per token, with optional dual clip and behaviour IS weights.

    Args:
        logp: [B, T] current policy logprobs (carry grad).
        old_logp: [B, T] logprobs under the weights the step started with.
        advantages, mask: [B, T].
        clip_low, clip_high: ratio clipped to [1 - clip_low, 1 + clip_high] (asymmetric, DAPO).
        dual_clip: > 1; for A < 0 the loss is capped at dual_clip * |A| (Ye et al. 2020), so a
            huge ratio on a bad token cannot blow up the update.
        is_weights: [B, T] behaviour-policy weights (see correction.py); detached here.

    Returns:
        (per_token_loss [B, T], 0 where mask is 0; stats) with stats: clip_frac (masked tokens
        where the clipped branch is active), ratio_mean, approx_kl (k3 of old vs new), and
        dual_clip_frac when dual_clip is set.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(
            f"dual_clip must be > 1 (the loss for A < 0 is capped at dual_clip * |A|), got "
            f"{dual_clip}; use e.g. 3.0, or None to disable"
        )
    ratio = torch.exp(torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -ratio * advantages
    clipped = -torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    stats = {"clip_frac": masked_mean((clipped > unclipped).float(), mask)}
    if dual_clip is not None:
        cap = -dual_clip * advantages
        capped = (advantages < 0) & (loss > cap)
        loss = torch.where(capped, cap, loss)
        stats["dual_clip_frac"] = masked_mean(capped.float(), mask)
    if is_weights is not None:
        loss = loss * is_weights.detach()
    stats["ratio_mean"] = masked_mean(ratio, mask)
    # Samples come from the old policy, so k3(old_logp, logp) estimates KL(old || new).
    stats["approx_kl"] = masked_mean(kl_penalty(old_logp, logp, "k3"), mask)
    return loss * mask, {k: v.detach() for k, v in stats.items()}


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071), its GSPO-token form, per token.

    The sequence ratio s_i = exp(mean over the row's masked tokens of logp - old_logp) (the
    geometric mean of the token ratios) is clipped per sequence to [1 - clip_low, 1 + clip_high];
    token t's term is -min(s_it A_it, clip(s_it) A_it) with s_it = sg(s_i) * pi_t / sg(pi_t):
    its value is s_i, its gradient s_i * grad log pi_t. With one advantage per sequence and
    algo.loss_agg=seq-mean-token-mean this is the paper's sequence-level GSPO (objective,
    clipping and gradient). A row lies whole in one micro-batch, so s_i does not depend on the
    split. The paper's clip ranges are small (3e-4 and 4e-4), not PPO's 0.2.

    Args and returns as `policy_loss`; dual_clip must be None (PPO's token-level cap). Stats:
    clip_frac (masked tokens of clipped sequences whose clipped branch is active), ratio_mean
    (of s_i over tokens), approx_kl (k3 of old vs new per token).
    """
    _refuse_dual_clip("gspo", dual_clip)
    on = mask.bool()
    log_ratio = torch.where(on, logp - old_logp, 0.0)
    seq = masked_mean(log_ratio, mask, dim=-1).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    # value s_i on every token, gradient s_i * d log pi_t (the paper's GSPO-token)
    ratio = torch.exp(seq[:, None] + torch.where(on, logp - logp.detach(), 0.0))
    unclipped = -ratio * advantages
    clipped = -torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    if is_weights is not None:
        loss = loss * is_weights.detach()
    stats = {"clip_frac": masked_mean((clipped > unclipped).float(), mask),
             "ratio_mean": masked_mean(ratio, mask),
             "approx_kl": masked_mean(kl_penalty(old_logp, logp, "k3"), mask)}
    return loss * mask, {k: v.detach() for k, v in stats.items()}


@POLICY_LOSSES.register("cispo")
def cispo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): -sg(min(r, 1 + clip_high)) * A * log pi per token.

    r = exp(logp - old_logp). The importance weight, not the update, is clipped: a token whose
    ratio is past the bound keeps its gradient (REINFORCE-style, weighted by the bound), where
    PPO's clip would drop it. As in the paper, there is no lower bound (its eps_low_IS is set
    "to a large value"): clip_low is not read (config refuses a changed algo.clip_low with
    cispo); clip_high = inf (M2PO) leaves the weight unclipped, M2PO's M * r * A.

    Args and returns as `policy_loss`; dual_clip must be None. The loss value is that of the
    surrogate above (its gradient is the paper's), not of the ratio objective. Stats: clip_frac
    (masked tokens whose weight is truncated), ratio_mean, approx_kl.
    """
    _refuse_dual_clip("cispo", dual_clip)
    ratio = torch.exp(torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weight = torch.clamp(ratio, max=1.0 + clip_high).detach()
    loss = -weight * advantages * torch.where(mask.bool(), logp, 0.0)
    if is_weights is not None:
        loss = loss * is_weights.detach()
    stats = {"clip_frac": masked_mean((ratio > 1.0 + clip_high).float(), mask),
             "ratio_mean": masked_mean(ratio, mask),
             "approx_kl": masked_mean(kl_penalty(old_logp, logp, "k3"), mask)}
    return loss * mask, {k: v.detach() for k, v in stats.items()}


def _refuse_dual_clip(name: str, dual_clip: float | None) -> None:
    if dual_clip is not None:
        raise ValueError(f"algo.dual_clip={dual_clip}: PPO's token-level cap is not part of algo.policy_loss="
                         f"{name}; remove algo.dual_clip, or use algo.policy_loss=ppo")


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Critic regression loss per token, optionally clipped around the rollout-time values.

    Args:
        values: [B, T] current critic values (carry grad); old_values: [B, T] at rollout time;
        returns: [B, T] targets; mask: [B, T].
        clip: values move at most this far from old_values before the loss stops rewarding
            them (pessimistic max of clipped and unclipped); None disables.

    Returns:
        (per_token_loss [B, T], 0 where mask is 0; stats) with value_clip_frac (masked tokens
        where the clipped term is the larger one; 0 when clip is None).
    """
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped * mask, {"value_clip_frac": torch.zeros((), device=values.device)}
    clipped_values = torch.clamp(values, old_values - clip, old_values + clip)
    clipped = (clipped_values - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped, clipped)
    frac = masked_mean((clipped > unclipped).float(), mask).detach()
    return loss * mask, {"value_clip_frac": frac}


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(policy || ref) from samples of the policy.

    Args:
        logp, ref_logp: same shape, e.g. [B, T].
        kind: an estimator registered in KL_KINDS (algo.kl_kind), applied to logp - ref_logp.

    Returns:
        Same shape as the inputs.
    """
    return KL_KINDS.get(kind)(logp - ref_logp)


@KL_KINDS.register("k1")
def _k1(diff: Tensor) -> Tensor:
    """logp - ref: unbiased, can be negative."""
    return diff


@KL_KINDS.register("k2")
def _k2(diff: Tensor) -> Tensor:
    """0.5 * (logp - ref)^2."""
    return 0.5 * diff**2


@KL_KINDS.register("k3")
def _k3(diff: Tensor) -> Tensor:
    """exp(ref - logp) - (ref - logp) - 1: Schulman's low-variance, non-negative estimator;
    exponent and result clamped for stability."""
    log_ratio = torch.clamp(-diff, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, max=K3_CLAMP)


@KL_KINDS.register("abs")
def _abs(diff: Tensor) -> Tensor:
    """|logp - ref|."""
    return diff.abs()


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: [..., V] -> [...].

    Plain version for unsharded logits; the vocab-parallel one lives with the model code.
    Logits must be finite: a -inf logit gives 0 * -inf = nan.
    """
    # float32: bf16 softmax over a 150k vocabulary loses most of the entropy's digits.
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
