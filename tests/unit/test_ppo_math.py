"""PPO/GRPO math against values worked out by hand in the comments."""

import re

import pytest
import torch

from megarl.config.registry import LOSS_AGGS
from megarl.config.schema import AlgoConfig, ConfigError
from megarl.ppo.advantages import (
    gae,
    group_normalized_advantages,
    grpo_advantages,
    kl_penalized_scores,
    last_index,
    masked_whiten,
    token_rewards,
)
from megarl.ppo.aggregate import aggregate, global_normalizer
from megarl.ppo.correction import behaviour_weights, mismatch_stats
from megarl.ppo.losses import entropy_from_logits, kl_penalty, policy_loss, value_loss

AGG_MODES = LOSS_AGGS.names()

GARBAGE = 9.0  # put in padded positions: any leak into a valid output shows up


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(actual, expected, atol=1e-5):
    return torch.allclose(torch.as_tensor(actual).float(), torch.as_tensor(expected).float(), atol=atol)


# --- advantages ------------------------------------------------------------------------------


def test_gae_two_rows_of_different_length():
    """GAE with gamma=0.9, lam=0.8 equals the hand recursion per row; padding gives 0 and leaks nothing."""
    rewards = t([[0.0, 0.0, 1.0, GARBAGE], [0.5, -1.0, GARBAGE, GARBAGE]])
    values = t([[0.5, 0.6, 0.7, GARBAGE], [0.2, 0.4, GARBAGE, GARBAGE]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # gamma * lam = 0.72, V after the last valid token = 0.
    # row 0: d2 = 1 - 0.7 = 0.3                 A2 = 0.3
    #        d1 = 0.9*0.7 - 0.6 = 0.03          A1 = 0.03 + 0.72*0.3   = 0.246
    #        d0 = 0.9*0.6 - 0.5 = 0.04          A0 = 0.04 + 0.72*0.246 = 0.21712
    # row 1: d1 = -1 - 0.4 = -1.4               A1 = -1.4
    #        d0 = 0.5 + 0.9*0.4 - 0.2 = 0.66    A0 = 0.66 - 0.72*1.4   = -0.348
    assert close(adv, [[0.21712, 0.246, 0.3, 0.0], [-0.348, -1.4, 0.0, 0.0]])
    # returns = A + V
    assert close(ret, [[0.71712, 0.846, 1.0, 0.0], [-0.148, -1.0, 0.0, 0.0]])


def test_gae_skips_observation_tokens_of_an_episode():
    """An episode row [model, model, obs, obs, model, pad]: the observation positions get no
    advantage, and the model tokens get exactly what the same row without them gets (the
    next state of the 2nd model token is the 3rd: no discount step, no zero value, no reset of
    the reward-to-go at the observation, whatever garbage the critic says there)."""
    rewards = t([[0.0, 0.0, GARBAGE, GARBAGE, 1.0, GARBAGE]])
    values = t([[0.5, 0.6, GARBAGE, GARBAGE, 0.7, GARBAGE]])
    mask = t([[1, 1, 0, 0, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # the compacted row is test_gae_two_rows_of_different_length's row 0
    assert close(adv, [[0.21712, 0.246, 0.0, 0.0, 0.3, 0.0]])
    assert close(ret, [[0.71712, 0.846, 0.0, 0.0, 1.0, 0.0]])


def test_the_score_lands_on_the_last_model_token():
    """token_rewards puts the score on the last mask-1 column (not at mask.sum() - 1, which an
    episode's observation holes would move onto an observation token)."""
    mask = t([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    assert last_index(mask).tolist() == [4, 2, 0]
    rewards = token_rewards(t([2.0, 3.0, 0.0]), mask, None, 0.0)
    assert rewards.tolist() == [[0, 0, 0, 0, 2.0, 0], [0, 0, 3.0, 0, 0, 0], [0] * 6]


def test_grpo_two_groups_of_three():
    """Group advantages use each group's own mean and population std; without std only the mean is removed."""
    scores = t([1.0, 0.0, 0.0, 2.0, 4.0, 6.0])
    # group 0: mean 1/3, var = (4/9 + 1/9 + 1/9)/3 = 2/9, std = sqrt(2)/3
    #          -> (2/3)/(sqrt(2)/3) = sqrt(2) = 1.41421, (-1/3)/(sqrt(2)/3) = -0.70711
    # group 1: mean 4, var = (4 + 0 + 4)/3 = 8/3, std = 1.63299 -> -1.22474, 0, 1.22474
    adv = group_normalized_advantages(scores, group_size=3)
    assert close(adv, [1.41421, -0.70711, -0.70711, -1.22474, 0.0, 1.22474])
    no_std = group_normalized_advantages(scores, group_size=3, std_normalize=False)
    assert close(no_std, [2 / 3, -1 / 3, -1 / 3, -2.0, 0.0, 2.0])


def test_grpo_constant_group_is_zero_and_bad_size_raises():
    """A group whose samples all scored the same gets 0 advantage (not nan); a partial group is an error."""
    adv = group_normalized_advantages(t([1.0, 1.0, 1.0, 0.0]), group_size=2)
    assert torch.equal(adv[:2], t([0.0, 0.0]))
    with pytest.raises(ValueError, match="group_size=4"):
        group_normalized_advantages(t([1.0, 2.0, 3.0]), group_size=4)


def _kl_batch():
    # 2 groups of 2; KL at padding is garbage and must not leak into the sums.
    scores = t([1.0, 0.0, 1.0, 1.0])
    kl = t([[0.1, 0.3, GARBAGE], [0.2, GARBAGE, GARBAGE], [0.0, 0.0, 0.0], [0.4, 0.4, 0.2]])
    mask = t([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]])
    return scores, kl, mask


def test_kl_penalized_scores():
    """score - kl_coef * (KL summed over the response's valid tokens); kl_coef 0 leaves scores as they are."""
    scores, kl, mask = _kl_batch()
    # KL sums 0.4, 0.2, 0.0, 1.0; * 0.5 -> 0.2, 0.1, 0.0, 0.5
    assert close(kl_penalized_scores(scores, kl, mask, kl_coef=0.5), [0.8, -0.1, 1.0, 0.5])
    assert torch.equal(kl_penalized_scores(scores, kl, mask, kl_coef=0.0), scores)
    with pytest.raises(ValueError, match="kl"):
        kl_penalized_scores(scores, kl[:3], mask[:3], kl_coef=0.5)


def test_grpo_kl_in_reward_changes_advantages():
    """GRPO with kl_mode=reward normalises the KL-penalised scores; kl_mode=loss leaves the KL to the loss."""
    scores, kl, mask = _kl_batch()
    in_reward = AlgoConfig(name="grpo", kl_mode="reward", kl_coef=0.5, grpo_std_normalize=False)
    # penalised scores 0.8, -0.1 | 1.0, 0.5 -> group means 0.35 | 0.75 -> 0.45, -0.45 | 0.25, -0.25
    adv = grpo_advantages(scores, kl, mask, in_reward, group_size=2)
    assert close(adv, [[0.45, 0.45, 0.0], [-0.45, 0.0, 0.0], [0.25, 0.25, 0.25], [-0.25, -0.25, -0.25]])
    # group 1 tied on the verifier: only the KL tells its samples apart (higher KL, lower advantage)
    in_loss = AlgoConfig(name="grpo", kl_mode="loss", kl_coef=0.5, grpo_std_normalize=False)
    adv = grpo_advantages(scores, kl, mask, in_loss, group_size=2)
    assert close(adv, [[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_masked_whiten():
    """Whitening uses only masked positions (population var) and zeroes the rest."""
    x = t([[1.0, 2.0, 3.0, 100.0]])
    mask = t([[1, 1, 1, 0]])
    # mean 2, var (1 + 0 + 1)/3 = 2/3, std 0.816497 -> -1.224745, 0, 1.224745
    assert close(masked_whiten(x, mask), [[-1.224745, 0.0, 1.224745, 0.0]])


# --- policy and value losses ---------------------------------------------------------------


def _ppo_batch():
    # ratios r = exp(logp - old) with old = 0; token 5 is padding with garbage logprobs.
    ratios = [1.1, 1.5, 5.0, 0.5, 0.5]
    logp = torch.cat([torch.log(t(ratios)), t([50.0])]).unsqueeze(0).requires_grad_()
    old = t([[0.0, 0.0, 0.0, 0.0, 0.0, -50.0]])
    adv = t([[1.0, 1.0, -1.0, 1.0, -1.0, 0.0]])
    mask = t([[1, 1, 1, 1, 1, 0]])
    return logp, old, adv, mask


def test_policy_loss_clip_and_dual_clip():
    """PPO loss picks clipped/unclipped branches by hand, dual clip caps A<0 at 3|A|, and clipped tokens get
    no gradient."""
    logp, old, adv, mask = _ppo_batch()
    loss, stats = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    # clip range [0.8, 1.28]; loss = max(-r A, -clip(r) A)
    # t0 A=+1 r=1.1 inside:           max(-1.1, -1.1)  = -1.1   (unclipped)
    # t1 A=+1 r=1.5 above:            max(-1.5, -1.28) = -1.28  (clipped)
    # t2 A=-1 r=5:                    max(5, 1.28) = 5 -> dual clip min(5, 3*1) = 3
    # t3 A=+1 r=0.5 below, A>0:       max(-0.5, -0.8)  = -0.5   (unclipped: keep pushing up)
    # t4 A=-1 r=0.5 below, A<0:       max(0.5, 0.8)    = 0.8    (clipped)
    # t5 padding:                     0
    assert close(loss.detach(), [[-1.1, -1.28, 3.0, -0.5, 0.8, 0.0]])
    assert close(stats["clip_frac"], 2 / 5)  # t1, t4
    assert close(stats["dual_clip_frac"], 1 / 5)  # t2
    assert close(stats["ratio_mean"], (1.1 + 1.5 + 5 + 0.5 + 0.5) / 5)  # 1.72
    # k3 = r - 1 - log r: 0.0046898, 0.0945349, 2.3905621, 0.1931472, 0.1931472 -> mean 0.5752162
    assert close(stats["approx_kl"], 0.5752162)
    loss.sum().backward()
    # d(-r A)/dlogp = -r A on unclipped tokens; clipped, dual-clipped and padded tokens: 0
    assert close(logp.grad, [[-1.1, 0.0, 0.0, -0.5, 0.0, 0.0]])


def test_policy_loss_is_weights_scale_and_are_detached():
    """Behaviour IS weights multiply the per-token loss and receive no gradient."""
    logp, old, adv, mask = _ppo_batch()
    w = t([[2.0, 1.0, 1.0, 1.0, 0.5, 1.0]]).requires_grad_()
    loss, _ = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, is_weights=w)
    # without dual clip t2 stays at 5; t0 * 2 = -2.2, t4 * 0.5 = 0.4
    assert close(loss.detach(), [[-2.2, -1.28, 5.0, -0.5, 0.4, 0.0]])
    loss.sum().backward()
    assert w.grad is None


def test_policy_loss_rejects_dual_clip_not_above_one():
    """dual_clip <= 1 would cap below the clipped loss itself: rejected, naming the value."""
    logp, old, adv, mask = _ppo_batch()
    with pytest.raises(ValueError, match="0.9"):
        policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip=0.9)


def test_value_loss_clip():
    """Clipped value loss is 0.5 * max(unclipped, clipped) squared error; clip frac counts where clipped wins."""
    values = t([[1.0, 1.5, 1.5, GARBAGE]])
    old = t([[0.9, 1.0, 1.0, 0.0]])
    returns = t([[1.5, 2.0, 1.0, 0.0]])
    mask = t([[1, 1, 1, 0]])
    loss, stats = value_loss(values, old, returns, mask, clip=0.2)
    # t0: clip(1.0, 0.7, 1.1) = 1.0; both (0.5)^2          -> 0.125
    # t1: clip(1.5, 0.8, 1.2) = 1.2; max(0.25, 0.8^2=0.64)  -> 0.32  (clipped wins)
    # t2: clip(1.5, 0.8, 1.2) = 1.2; max(0.25, 0.2^2=0.04)  -> 0.125
    assert close(loss, [[0.125, 0.32, 0.125, 0.0]])
    assert close(stats["value_clip_frac"], 1 / 3)
    unclipped, stats = value_loss(values, old, returns, mask, clip=None)
    assert close(unclipped, [[0.125, 0.125, 0.125, 0.0]])
    assert close(stats["value_clip_frac"], 0.0)


def test_kl_kinds_at_known_values():
    """k1, k2, k3 and abs at logp - ref = +0.5 and -0.5 match the formulas."""
    logp = t([-1.0, -2.0])
    ref = t([-1.5, -1.5])  # logp - ref = [0.5, -0.5]
    assert close(kl_penalty(logp, ref, "k1"), [0.5, -0.5])
    assert close(kl_penalty(logp, ref, "k2"), [0.125, 0.125])
    # k3 = exp(ref - logp) - (ref - logp) - 1: exp(-0.5) + 0.5 - 1 = 0.1065307;
    #                                          exp(0.5) - 0.5 - 1  = 0.1487213
    assert close(kl_penalty(logp, ref, "k3"), [0.1065307, 0.1487213])
    assert close(kl_penalty(logp, ref, "abs"), [0.5, 0.5])


def test_k3_stays_finite_for_huge_gaps():
    """k3 never overflows: a 1000-nat gap gives a finite, clamped penalty."""
    out = kl_penalty(t([0.0, -1000.0]), t([-1000.0, 0.0]), "k3")
    assert torch.isfinite(out).all()


def test_entropy_from_logits():
    """Entropy of softmax over the last dim: uniform over 4 is ln 4; (1/2, 1/4, 1/4) is 1.5 ln 2."""
    uniform = torch.zeros(2, 3, 4)
    assert close(entropy_from_logits(uniform), torch.full((2, 3), 1.3862944))
    # H = 0.5 ln 2 + 2 * 0.25 ln 4 = 1.5 ln 2 = 1.0397208
    logits = torch.log(t([0.5, 0.25, 0.25])) + 7.0  # shift must not matter
    assert close(entropy_from_logits(logits), 1.0397208)


# --- behaviour correction ------------------------------------------------------------------


def _token_weights_batch():
    # w = exp(old - behav) = [0.5, 1.5, 4.0]; position 3 is padding with an infinite gap.
    old = torch.log(t([[0.5, 1.5, 4.0, 1.0]]))
    behav = t([[0.0, 0.0, 0.0, float("-inf")]])
    mask = t([[1, 1, 1, 0]])
    return old, behav, mask


def test_tis_truncates_at_cap():
    """TIS: min(w, cap) per token, 0 on padding; stats describe the raw weights."""
    old, behav, mask = _token_weights_batch()
    w, stats = behaviour_weights(old, behav, mask, mode="tis", level="token", cap=2.0, low=0.0, high=0.0)
    assert close(w, [[0.5, 1.5, 2.0, 0.0]])
    assert close(stats["is_weight_mean"], 2.0)  # (0.5 + 1.5 + 4) / 3
    assert close(stats["is_weight_max"], 4.0)
    assert close(stats["is_masked_frac"], 0.0)


def test_mask_mode_drops_tokens_outside_range():
    """Mask mode: weight 1 inside [low, high], 0 outside; none mode: 1 on every valid token."""
    old, behav, mask = _token_weights_batch()
    w, stats = behaviour_weights(old, behav, mask, mode="mask", level="token", cap=0.0, low=0.6, high=3.0)
    assert torch.equal(w, t([[0.0, 1.0, 0.0, 0.0]]))  # 0.5 < 0.6 and 4 > 3 dropped
    assert close(stats["is_masked_frac"], 2 / 3)
    w, _ = behaviour_weights(old, behav, mask, mode="none", level="token", cap=0.0, low=0.0, high=0.0)
    assert torch.equal(w, t([[1.0, 1.0, 1.0, 0.0]]))


def test_sequence_levels():
    """Sequence level uses exp(sum) per row, geo_sequence exp(mean), broadcast to the row's tokens."""
    old = t([[0.1, 0.2, 0.3, 5.0], [-0.4, 0.0, 5.0, 5.0]])  # padding gap 5 must be ignored
    behav = torch.zeros(2, 4)
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    args = dict(cap=1.5, low=0.0, high=0.0)
    w, _ = behaviour_weights(old, behav, mask, mode="tis", level="sequence", **args)
    # row 0: exp(0.6) = 1.8221 -> cap 1.5; row 1: exp(-0.4) = 0.6703200
    assert close(w, [[1.5, 1.5, 1.5, 0.0], [0.67032, 0.67032, 0.0, 0.0]])
    w, _ = behaviour_weights(old, behav, mask, mode="tis", level="geo_sequence", **args)
    # row 0: exp(0.6 / 3) = 1.2214028; row 1: exp(-0.4 / 2) = 0.8187308
    assert close(w, [[1.2214028, 1.2214028, 1.2214028, 0.0], [0.8187308, 0.8187308, 0.0, 0.0]])
    w, _ = behaviour_weights(old, behav, mask, mode="tis", level="token", **args)
    assert close(w, [[1.1051709, 1.2214028, 1.3498588, 0.0], [0.67032, 1.0, 0.0, 0.0]])


def test_mismatch_stats():
    """Mismatch stats are mean, max and exp(mean) of |trainer - engine| over valid tokens only."""
    trainer = t([[-1.0, -2.0, -0.5, 9.0]])
    engine = t([[-1.1, -1.7, -0.5, -9.0]])
    mask = t([[1, 1, 1, 0]])
    stats = mismatch_stats(trainer, engine, mask)
    # |d| = 0.1, 0.3, 0.0 -> mean 0.133333, max 0.3, exp(0.133333) = 1.1426308
    assert close(stats["logprob_mismatch_mean"], 0.1333333)
    assert close(stats["logprob_mismatch_max"], 0.3)
    assert close(stats["logprob_mismatch_exp"], 1.1426308)


# --- aggregation ---------------------------------------------------------------------------


def test_aggregate_modes_by_hand():
    """Each aggregation mode on a 2-row batch, with normalisers from global_normalizer."""
    loss = t([[1.0, 2.0, 3.0], [4.0, GARBAGE, GARBAGE], [GARBAGE, GARBAGE, GARBAGE]])
    mask = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # row 2: fully padded filler, not a sequence
    assert global_normalizer(mask, "token-mean") == 4.0
    assert global_normalizer(mask, "seq-mean-token-mean") == 2.0
    assert global_normalizer(mask, "seq-mean-token-sum-norm", max_len=4) == 8.0  # 2 sequences x budget 4
    # token-mean (6 + 4) / 4 = 2.5; seq-mean-token-mean (2 + 4) / 2 = 3; seq-mean-token-sum (6 + 4) / 2 = 5;
    # seq-mean-token-sum-norm (6 + 4) / (2 * 4) = 1.25
    expected = {"token-mean": 2.5, "seq-mean-token-mean": 3.0, "seq-mean-token-sum": 5.0,
                "seq-mean-token-sum-norm": 1.25}
    assert set(expected) == set(AGG_MODES)
    for mode, value in expected.items():
        assert close(aggregate(loss, mask, mode, global_normalizer(mask, mode, max_len=4)), value), mode


def test_token_sum_norm_divides_by_the_budget_not_the_lengths():
    """seq-mean-token-sum-norm (Dr. GRPO): the divisor is sequences x max_len whatever the lengths; max_len
    is required and must cover every response."""
    mode = "seq-mean-token-sum-norm"
    long = t([[1, 1, 1, 1], [1, 1, 1, 0]])
    short = t([[1, 0, 0, 0], [1, 1, 0, 0]])
    assert global_normalizer(long, mode, max_len=8) == global_normalizer(short, mode, max_len=8) == 16.0
    # a per-token loss of 1 everywhere: the loss grows with the number of tokens (no per-sequence length
    # normalisation): 7 / 16 and 3 / 16
    ones = torch.ones(2, 4)
    assert close(aggregate(ones, long, mode, 16.0), 7 / 16)
    assert close(aggregate(ones, short, mode, 16.0), 3 / 16)
    with pytest.raises(ValueError, match="max_len.*rollout.sampling.max_new_tokens"):
        global_normalizer(long, mode)
    with pytest.raises(ValueError, match="max_len=3"):
        global_normalizer(long, mode, max_len=3)  # row 0 has 4 tokens: not a budget


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_aggregate_invariant_to_microbatch_split(mode, chunks):
    """Summing aggregate over 1, 2 or 4 microbatches with the global normaliser equals the whole batch."""
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(8, 6, generator=gen)
    lengths = torch.tensor([6, 1, 3, 0, 5, 2, 4, 6])
    mask = (torch.arange(6) < lengths[:, None]).float()
    norm = global_normalizer(mask, mode, max_len=6)
    whole = aggregate(loss, mask, mode, norm)
    parts = sum(aggregate(lc, mc, mode, norm) for lc, mc in zip(loss.chunk(chunks), mask.chunk(chunks)))
    assert torch.allclose(parts, whole, atol=1e-6)
    if chunks == 4 and mode == "token-mean":
        # the naive way (each microbatch normalised locally, then averaged) must differ
        local = [aggregate(lc, mc, mode, global_normalizer(mc, mode)) for lc, mc in zip(loss.chunk(4), mask.chunk(4))]
        assert not torch.allclose(sum(local) / 4, whole, atol=1e-3)


# --- bad names -----------------------------------------------------------------------------


def test_algo_config_accepts_exactly_the_aggregation_modes():
    """algo.loss_agg admits every mode aggregate implements; anything else is a ConfigError naming the key."""
    for mode in AGG_MODES:
        assert AlgoConfig(loss_agg=mode).loss_agg == mode
    with pytest.raises(ConfigError, match="algo.loss_agg.*seq-mean-token-sum-norm"):
        AlgoConfig(loss_agg="dr-grpo")


@pytest.mark.parametrize(
    "call, bad",
    [
        (lambda: kl_penalty(t([0.0]), t([0.0]), "k4"), "k4"),
        (lambda: behaviour_weights(t([[0.0]]), t([[0.0]]), t([[1.0]]), "trunc", "token", 2.0, 0.5, 2.0), "trunc"),
        (lambda: behaviour_weights(t([[0.0]]), t([[0.0]]), t([[1.0]]), "tis", "seq", 2.0, 0.5, 2.0), "seq"),
        (lambda: aggregate(t([[0.0]]), t([[1.0]]), "mean", 1.0), "mean"),
        (lambda: global_normalizer(t([[1.0]]), "token_mean"), "token_mean"),
    ],
)
def test_bad_names_raise_value_error_naming_them(call, bad):
    """Unknown KL kind, IS mode/level or aggregation mode raises ValueError quoting the bad value."""
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        call()
