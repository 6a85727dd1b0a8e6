"""Advantage estimators: GAE for PPO with a critic, group-normalised scores for GRPO, RLOO's
leave-one-out baseline and REINFORCE++-baseline (docs/algorithms.md); DAPO's overlong shaping.

Pure tensor functions: no process groups, so they run and are tested on CPU. Each algo.name is
an `Estimator` registered in ADVANTAGES (at the bottom): the step looks it up, runs the critic
if it needs one, and calls it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from megarl.config.registry import ADVANTAGES
from megarl.config.schema import AlgoConfig


@torch.no_grad()  # advantages and returns are targets: never differentiated
def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over response tokens.

    Args:
        rewards: [B, T] per-token rewards (sequence score on the last valid token, per-token
            KL penalties elsewhere).
        values: [B, T] critic values V(s_t).
        mask: [B, T] 1 on trained tokens, 0 elsewhere: padding after the response and, in
            multi-turn episodes, the observation tokens between model turns.
        gamma: discount; lam: GAE lambda.

    Returns:
        (advantages, returns), both [B, T] and 0 where mask is 0; returns = advantages + values.

    Masked positions are skipped, not zero-valued steps: the next state of a model token is the
    next *model* token (observation tokens are the environment's move, not the policy's), so
    the discount and the bootstrap value jump over them and the reward-to-go is not reset at
    an observation. With a contiguous mask this is the usual recursion.
    """
    # Critic outputs at padding are garbage; zeroing them makes V = 0 after the last valid
    # token (the episode ends there), so rows of different lengths need no special case.
    rewards = rewards * mask
    values = values * mask
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_adv = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = adv
        on = mask[:, t] > 0
        next_adv = torch.where(on, adv, next_adv)
        next_value = torch.where(on, values[:, t], next_value)
    advantages = advantages * mask
    return advantages, advantages + values


def group_normalized_advantages(
    scores: Tensor, group_size: int, std_normalize: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO advantages: each score relative to the other samples of its prompt.

    Args:
        scores: [B] sequence scores, B = num_groups * group_size; consecutive samples belong
            to the same group.
        group_size: samples per prompt.
        std_normalize: divide by the group's std (GRPO) or only subtract the mean (Dr. GRPO).
        eps: keeps groups whose samples all scored the same at 0 instead of nan.

    Returns:
        [B] advantages. The std is the population std (unbiased=False): the group is the whole
        population being compared, and it stays defined for group_size 1.
    """
    if scores.dim() != 1 or scores.numel() % group_size != 0:
        raise ValueError(
            f"scores must be 1-D with a length divisible by group_size={group_size}, "
            f"got shape {tuple(scores.shape)}; pass whole groups, consecutive per prompt"
        )
    groups = scores.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if std_normalize:
        centred = centred / (groups.std(dim=1, unbiased=False, keepdim=True) + eps)
    return centred.view(-1)


def rloo_advantages(scores: Tensor, group_size: int) -> Tensor:
    """RLOO (Ahmadian et al. 2024, arXiv 2402.14740): each score minus the mean of the other
    group_size - 1 scores of its group, A_i = R_i - sum_{j != i} R_j / (n - 1) = n / (n - 1) *
    (R_i - mean). scores: [B], consecutive groups of group_size >= 2. Returns [B]."""
    if group_size < 2 or scores.dim() != 1 or scores.numel() % group_size != 0:
        raise ValueError(
            f"RLOO needs whole groups of at least 2 samples: scores of shape {tuple(scores.shape)} in groups of "
            f"{group_size}; use rollout.sampling.n >= 2"
        )
    groups = scores.view(-1, group_size)
    others = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return (groups - others).view(-1)


def reinforce_pp_baseline_advantages(scores: Tensor, mask: Tensor, group_size: int) -> Tensor:
    """REINFORCE++-baseline (Hu et al. 2025, arXiv 2501.03262; OpenRLHF's reinforce_baseline,
    veRL's and slime's reinforce_plus_plus_baseline): the group mean subtracted from each score,
    put on every response token, then whitened over all the batch's tokens (mean 0, std 1,
    `masked_whiten`). scores: [B] in consecutive groups; mask [B, R]. Returns [B, R]."""
    centred = group_normalized_advantages(scores, group_size, std_normalize=False)
    return masked_whiten(centred[:, None] * mask, mask)


def discounted_returns(rewards: Tensor, gamma: float) -> Tensor:
    """[B, R]: G_t = r_t + gamma * G_{t+1}, from the last position back. Positions a sample does
    not train (observation tokens between its turns, padding: reward 0) pass the return on."""
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        running = rewards[:, t] + gamma * running
        out[:, t] = running
    return out


def reinforce_pp_advantages(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """REINFORCE++ (Hu et al. 2025, arXiv 2501.03262, sec. 3; OpenRLHF's `reinforce`, veRL's
    reinforce_plus_plus): per-token rewards (the score on the last token, the KL penalty on
    every token: `token_rewards`), their discounted returns, whitened over all the batch's
    response tokens (`masked_whiten`). No group baseline: groups of any size. rewards and mask
    [B, R]. Returns [B, R], 0 off the mask."""
    return masked_whiten(discounted_returns(rewards, gamma) * mask, mask)


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), scaled by
    `penalty` (veRL's penalty_factor): 0 for a response of at most max_new_tokens - buffer
    tokens, then falling linearly to -penalty at max_new_tokens, -penalty beyond.

    Args:
        lengths: [B] response tokens of each sample.
        max_new_tokens: the generation budget L_max (rollout.sampling.max_new_tokens).
        buffer: L_cache (reward.overlong_buffer), 0 < buffer < max_new_tokens.
        penalty: the largest penalty (reward.overlong_penalty), >= 0.

    Returns:
        [B] float, <= 0: added to each sample's score.
    """
    if not 0 < buffer < max_new_tokens:
        raise ValueError(f"reward.overlong_buffer={buffer} must be in (0, rollout.sampling.max_new_tokens="
                         f"{max_new_tokens})")
    excess = lengths.float() - (max_new_tokens - buffer)
    return -penalty * torch.clamp(excess / buffer, 0.0, 1.0)


@torch.no_grad()  # a target, like the advantages built from it
def kl_penalized_scores(scores: Tensor, kl: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """GRPO's sequence scores with the KL penalty in the reward (algo.kl_mode=reward).

    Args:
        scores: [B] verifier scores.
        kl: [B, T] per-token KL estimate to the reference policy; padding may hold anything.
        mask: [B, T] 1 on response tokens.
        kl_coef: penalty weight (>= 0).

    Returns:
        [B] scores - kl_coef * sum_t(kl * mask): the sequence-level return of PPO's per-token
        rewards (score on the last token, -kl_coef * KL on every token) at gamma = 1, so the
        penalty means the same under both estimators. It is summed, not averaged, because the
        KL of a sequence to the reference is the sum of its per-token log-ratios. Group
        normalisation then subtracts the group mean, so only KL differences between samples of
        one prompt move advantages; with std_normalize, a group whose verifier scores tie is
        ranked by KL alone (scaled to unit std), so keep kl_coef small or use kl_mode=loss.
    """
    if kl.shape != mask.shape or kl.dim() != 2 or scores.shape != kl.shape[:1]:
        raise ValueError(
            f"need scores [B] and kl, mask [B, T]; got scores {tuple(scores.shape)}, "
            f"kl {tuple(kl.shape)}, mask {tuple(mask.shape)}"
        )
    if not kl_coef:
        return scores
    return scores - kl_coef * (kl * mask).sum(dim=-1)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """Zero-mean, unit-variance over masked positions (population variance).

    Args:
        x, mask: same shape, e.g. [B, T]; mask 1 where x counts.

    Returns:
        Same shape as x; masked-out positions are 0.
    """
    n = mask.sum().clamp_min(1)
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / n
    return (x - mean) * torch.rsqrt(var + eps) * mask


def last_index(mask: Tensor) -> Tensor:
    """[B] column of each row's last nonzero mask entry (0 for an empty row): the last trained
    token, also when observation tokens leave holes in the mask."""
    cols = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return ((mask > 0) * cols).amax(dim=1).sub(1).clamp(min=0)


def token_rewards(scores: Tensor, mask: Tensor, kl: Tensor | None, kl_coef: float) -> Tensor:
    """[B, R]: the verifier score [B] on each sequence's last token, minus kl_coef * KL per
    token (kl [B, R], None for no penalty)."""
    rewards = torch.zeros_like(mask)
    last = last_index(mask)
    rewards[torch.arange(mask.shape[0], device=mask.device), last] = scores
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl * mask
    return rewards


def grpo_advantages(scores: Tensor, kl: Tensor, mask: Tensor, algo: AlgoConfig,
                    group_size: int) -> Tensor:
    """[B, R] GRPO advantages: each sequence's group-normalised score on all its tokens.

    scores [B], kl and mask [B, R]. With kl_mode=reward the score is first reduced by
    kl_coef * the response's summed KL (`kl_penalized_scores`: what PPO's per-token rewards add
    up to); with kl_mode=loss the KL stays out of the advantages (the actor loss carries it).
    """
    if algo.kl_mode == "reward":
        scores = kl_penalized_scores(scores, kl, mask, algo.kl_coef)
    return group_normalized_advantages(scores, group_size, algo.grpo_std_normalize)[:, None] * mask


@dataclass(frozen=True)
class Estimator:
    """One algo.name. `fn(scores [B], kl [B, R], mask [B, R], values [B, R] or None, algo,
    group_size) -> (advantages [B, R], returns [B, R] or None)`; `needs_critic`: the step runs
    the critic for `values` (and trains it), else values is None and there is no critic."""
    fn: Callable[..., tuple[Tensor, Optional[Tensor]]]
    needs_critic: bool


def _ppo(scores: Tensor, kl: Tensor, mask: Tensor, values: Tensor | None, algo: AlgoConfig,
         group_size: int) -> tuple[Tensor, Tensor]:
    """GAE over per-token rewards (score on the last token; the KL penalty per token with
    kl_mode=reward), whitened over the batch's tokens with algo.whiten_advantages."""
    rewards = token_rewards(scores, mask, kl if algo.kl_mode == "reward" else None, algo.kl_coef)
    advantages, returns = gae(rewards, values, mask, algo.gamma, algo.lam)
    if algo.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def _grpo(scores: Tensor, kl: Tensor, mask: Tensor, values: Tensor | None, algo: AlgoConfig,
          group_size: int) -> tuple[Tensor, None]:
    return grpo_advantages(scores, kl, mask, algo, group_size), None


def _sequence_scores(scores: Tensor, kl: Tensor, mask: Tensor, algo: AlgoConfig) -> Tensor:
    """[B] scores, less kl_coef * the response's summed KL with kl_mode=reward (as GRPO's)."""
    return kl_penalized_scores(scores, kl, mask, algo.kl_coef) if algo.kl_mode == "reward" else scores


def _rloo(scores: Tensor, kl: Tensor, mask: Tensor, values: Tensor | None, algo: AlgoConfig,
          group_size: int) -> tuple[Tensor, None]:
    return rloo_advantages(_sequence_scores(scores, kl, mask, algo), group_size)[:, None] * mask, None


def _reinforce_pp_baseline(scores: Tensor, kl: Tensor, mask: Tensor, values: Tensor | None, algo: AlgoConfig,
                           group_size: int) -> tuple[Tensor, None]:
    return reinforce_pp_baseline_advantages(_sequence_scores(scores, kl, mask, algo), mask, group_size), None


ADVANTAGES.register("ppo", Estimator(_ppo, needs_critic=True))
ADVANTAGES.register("grpo", Estimator(_grpo, needs_critic=False))
ADVANTAGES.register("rloo", Estimator(_rloo, needs_critic=False))
def _reinforce_pp(scores: Tensor, kl: Tensor, mask: Tensor, values: Tensor | None, algo: AlgoConfig,
                  group_size: int) -> tuple[Tensor, None]:
    rewards = token_rewards(scores, mask, kl if algo.kl_mode == "reward" else None, algo.kl_coef)
    return reinforce_pp_advantages(rewards, mask, algo.gamma), None


ADVANTAGES.register("reinforce_plus_plus_baseline", Estimator(_reinforce_pp_baseline, needs_critic=False))
ADVANTAGES.register("reinforce_plus_plus", Estimator(_reinforce_pp, needs_critic=False))
