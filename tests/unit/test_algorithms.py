"""The recipes users bring from veRL and slime (docs/algorithms.md): GSPO and CISPO policy losses,
RLOO and REINFORCE++-baseline advantages, DAPO's overlong punishment and truncation masking.

Each is checked against a reference written from its paper, on hand-computed cases, and each
check is shown to catch a deliberately wrong variant (the variant is run through the same
comparison and must fail it). The default loss (algo.policy_loss=ppo) is checked bit for bit
against the clipped loss as it was before the registry."""
from __future__ import annotations

import math
import re

import pytest
import torch

from megarl.config import ConfigError, load_config
from megarl.config.registry import ADVANTAGES, POLICY_LOSSES
from megarl.config.schema import AlgoConfig
from megarl.data.sample import Sample
from megarl.ppo.advantages import (
    group_normalized_advantages,
    masked_whiten,
    overlong_penalty,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from megarl.ppo.aggregate import aggregate, global_normalizer
from megarl.ppo.batch import build_batch
from megarl.ppo.losses import cispo_loss, gspo_loss, kl_penalty, masked_mean, policy_loss
from megarl.ppo.step import shaped

RECIPE = "recipes/tiny_cpu.yaml"


def _one_line(err) -> str:
    line = str(err.value)
    assert "\n" not in line
    return line


# ------------------------------------------------------------------------------- ppo, unchanged
def _ppo_before(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip=None, is_weights=None):
    """megarl/ppo/losses.py policy_loss as it was before algo.policy_loss (the loss only)."""
    ratio = torch.exp(torch.clamp(logp - old_logp, -20.0, 20.0))
    unclipped = -ratio * advantages
    clipped = -torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        cap = -dual_clip * advantages
        loss = torch.where((advantages < 0) & (loss > cap), cap, loss)
    if is_weights is not None:
        loss = loss * is_weights.detach()
    return loss * mask


def _batch(seed=0, rows=4, cols=6):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, cols, generator=gen) * 3
    old = logp + torch.randn(rows, cols, generator=gen) * 0.4
    adv = torch.randn(rows, 1, generator=gen).expand(rows, cols).contiguous()
    mask = (torch.arange(cols) < torch.tensor([[6], [4], [2], [5]])[:rows]).float()
    is_w = torch.rand(rows, cols, generator=gen) + 0.5
    return logp, old, adv, mask, is_w


@pytest.mark.parametrize("dual_clip, with_is", [(None, False), (3.0, True)])
def test_the_default_loss_is_todays_clipped_loss_bit_for_bit(dual_clip, with_is):
    logp, old, adv, mask, is_w = _batch()
    fn = POLICY_LOSSES.get(AlgoConfig().policy_loss)
    assert fn is policy_loss
    a, b = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    w = is_w if with_is else None
    now, _ = fn(a, old, adv, mask, 0.2, 0.28, dual_clip, w)
    before = _ppo_before(b, old, adv, mask, 0.2, 0.28, dual_clip, w)
    norm = global_normalizer(mask, "token-mean")
    aggregate(now, mask, "token-mean", norm).backward()
    aggregate(before, mask, "token-mean", norm).backward()
    assert torch.equal(now, before) and torch.equal(a.grad, b.grad)


# ------------------------------------------------------------------------------------- GSPO
def _gspo_paper(logp, old_logp, advantages, mask, eps_low, eps_high):
    """GSPO's objective as the paper writes it (eq. 5-7): J = 1/G sum_i min(s_i A_i, clip(s_i,
    1 - eps_low, 1 + eps_high) A_i), s_i = (pi(y_i) / pi_old(y_i))^(1 / |y_i|), one row at a time,
    differentiated through s_i itself. Returns the loss -J."""
    terms = []
    for i in range(logp.shape[0]):
        n = int(mask[i].sum())
        s = torch.exp((logp[i, :n] - old_logp[i, :n]).sum() / n)
        a = advantages[i, 0]
        terms.append(torch.minimum(s * a, torch.clamp(s, 1 - eps_low, 1 + eps_high) * a))
    return -torch.stack(terms).mean()


def _gspo_via_loss(fn, logp, old, adv, mask, lo, hi, chunks=(slice(None),)):
    """`fn`'s per-token loss aggregated as the step does (seq-mean-token-mean, global normaliser),
    micro-batch by micro-batch over `chunks` of rows."""
    norm = global_normalizer(mask, "seq-mean-token-mean")
    total = 0.0
    for c in chunks:
        per_token, _ = fn(logp[c], old[c], adv[c], mask[c], lo, hi)
        total = total + aggregate(per_token, mask[c], "seq-mean-token-mean", norm)
    return total


def _matches_paper(fn, logp, old, adv, mask, lo, hi) -> bool:
    a, b = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    mine, ref = _gspo_via_loss(fn, a, old, adv, mask, lo, hi), _gspo_paper(b, old, adv, mask, lo, hi)
    mine.backward()
    ref.backward()
    return bool(torch.allclose(mine, ref, atol=1e-6) and torch.allclose(a.grad * mask, b.grad * mask, atol=1e-6))


def test_gspo_by_hand():
    """Row 0: log ratios 0.1, 0.3 (mean 0.2, s = e^0.2 = 1.2214), A = +1, clipped at 1.2: its
    term is -1.2 with no gradient. Row 1: log ratios -0.1, 0, 0.1 (s = 1), A = -2: term 2, and
    d/dlogp_t = -A s / |y| / G = 2 / 3 / 2 per token."""
    old = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]])
    logp = (old + torch.tensor([[0.1, 0.3, 0.0], [-0.1, 0.0, 0.1]])).requires_grad_()
    adv = torch.tensor([[1.0], [-2.0]]).expand(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    per_token, stats = gspo_loss(logp, old, adv, mask, 0.2, 0.2)
    assert torch.allclose(per_token, torch.tensor([[-1.2, -1.2, 0.0], [2.0, 2.0, 2.0]]))
    loss = aggregate(per_token, mask, "seq-mean-token-mean", global_normalizer(mask, "seq-mean-token-mean"))
    assert torch.isclose(loss, torch.tensor((-1.2 + 2.0) / 2))
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]]))
    assert torch.isclose(stats["clip_frac"], torch.tensor(2 / 5))   # row 0's two tokens
    assert torch.isclose(stats["ratio_mean"], torch.tensor((2 * math.exp(0.2) + 3) / 5))


@pytest.mark.parametrize("lo, hi, scale", [(0.2, 0.2, 1.0), (3e-4, 4e-4, 0.05)])
def test_gspo_is_the_papers_sequence_objective_and_gradient(lo, hi, scale):
    logp, old, adv, mask, _ = _batch(seed=3)
    old = logp + (old - logp) * scale    # log ratios where the clip holds some rows, not all
    assert 0 < gspo_loss(logp, old, adv, mask, lo, hi)[1]["clip_frac"] < 1
    assert _matches_paper(gspo_loss, logp, old, adv, mask, lo, hi)


def test_gspo_check_catches_wrong_variants():
    """Token-level PPO, an arithmetic mean of the token ratios, or a sum instead of a mean of the
    log ratios: each fails the comparison with the paper."""
    logp, old, adv, mask, _ = _batch(seed=2)

    def arithmetic(logp, old_logp, advantages, mask, lo, hi):
        r = masked_mean(torch.exp(logp - old_logp), mask, dim=-1)
        ratio = r.detach()[:, None] * torch.exp(logp - logp.detach())
        loss = torch.maximum(-ratio * advantages, -torch.clamp(ratio, 1 - lo, 1 + hi) * advantages)
        return loss * mask, {}

    def summed(logp, old_logp, advantages, mask, lo, hi):   # the sequence ratio, not its |y|-th root
        log_s = ((logp - old_logp) * mask).sum(-1).detach()
        ratio = torch.exp(log_s[:, None] + logp - logp.detach())
        loss = torch.maximum(-ratio * advantages, -torch.clamp(ratio, 1 - lo, 1 + hi) * advantages)
        return loss * mask, {}

    def ppo(logp, old_logp, advantages, mask, lo, hi):
        return policy_loss(logp, old_logp, advantages, mask, lo, hi)
    assert _matches_paper(gspo_loss, logp, old, adv, mask, 0.2, 0.2)
    for wrong in (arithmetic, summed, ppo):
        assert not _matches_paper(wrong, logp, old, adv, mask, 0.2, 0.2), wrong.__name__


def test_gspo_does_not_depend_on_the_micro_batch_split():
    logp, old, adv, mask, _ = _batch(seed=3)
    whole = _gspo_via_loss(gspo_loss, logp, old, adv, mask, 0.2, 0.2)
    split = _gspo_via_loss(gspo_loss, logp, old, adv, mask, 0.2, 0.2, chunks=(slice(0, 1), slice(1, 3), slice(3, 4)))
    assert torch.allclose(whole, split, atol=1e-7)


def test_gspo_and_cispo_apply_the_behaviour_weights_detached():
    logp, old, adv, mask, is_w = _batch(seed=4)
    for fn in (gspo_loss, cispo_loss):
        w, lp = is_w.clone().requires_grad_(), logp.clone().requires_grad_()
        plain, _ = fn(logp, old, adv, mask, 0.2, 0.2)
        weighted, _ = fn(lp, old, adv, mask, 0.2, 0.2, None, w)
        assert torch.allclose(weighted, plain * is_w)
        weighted.sum().backward()
        assert w.grad is None and lp.grad is not None


def test_gspo_and_cispo_refuse_a_dual_clip():
    logp, old, adv, mask, _ = _batch()
    for fn in (gspo_loss, cispo_loss):
        with pytest.raises(ValueError, match=r"algo\.dual_clip=3\.0: .*remove algo\.dual_clip"):
            fn(logp, old, adv, mask, 0.2, 0.2, 3.0)


# ------------------------------------------------------------------------------------ CISPO
def _cispo_paper(logp, old_logp, advantages, mask, eps_high):
    """MiniMax-M1 eq. 4, with eps_low_IS large (no lower bound) as the paper trains: J = 1 /
    sum|o_i| sum_i,t sg(r_hat) A log pi, r_hat = clip(r, 0, 1 + eps_high). Returns -J."""
    total, count = 0.0, 0
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[i, t]:
                r = torch.exp(logp[i, t] - old_logp[i, t]).detach()
                total = total + min(float(r), 1 + eps_high) * advantages[i, t] * logp[i, t]
                count += 1
    return -total / count


def _cispo_matches(fn, logp, old, adv, mask, hi, lo=0.2) -> bool:
    a, b = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    per_token, _ = fn(a, old, adv, mask, lo, hi)
    mine = aggregate(per_token, mask, "token-mean", global_normalizer(mask, "token-mean"))
    ref = _cispo_paper(b, old, adv, mask, hi)
    mine.backward()
    ref.backward()
    return bool(torch.allclose(mine, ref, atol=1e-6) and torch.allclose(a.grad, b.grad, atol=1e-6))


def test_cispo_by_hand():
    """Log ratios 0, log 1.6, log 0.5 with A = 1, clip_high 0.2: weights 1, 1.2 (truncated),
    0.5 (no lower bound); each token's gradient is -w A, also the truncated one's (PPO's clip
    would give it none)."""
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    logp = (old + torch.log(torch.tensor([[1.0, 1.6, 0.5]]))).requires_grad_()
    adv, mask = torch.ones(1, 3), torch.ones(1, 3)
    per_token, stats = cispo_loss(logp, old, adv, mask, 0.2, 0.2)
    w = torch.tensor([[1.0, 1.2, 0.5]])
    assert torch.allclose(per_token, -w * logp.detach())
    per_token.sum().backward()
    assert torch.allclose(logp.grad, -w)
    assert torch.isclose(stats["clip_frac"], torch.tensor(1 / 3))


@pytest.mark.parametrize("hi", [0.2, 2.0])
def test_cispo_is_the_papers_objective_and_gradient(hi):
    logp, old, adv, mask, _ = _batch(seed=5)
    assert 0 < cispo_loss(logp, old, adv, mask, 0.2, hi)[1]["clip_frac"] < 1 or hi > 1
    assert _cispo_matches(cispo_loss, logp, old, adv, mask, hi)


def test_cispo_check_catches_wrong_variants():
    """The weight not detached, a lower bound at 1 - clip_low, or PPO's clipped ratio: each fails."""
    logp, old, adv, mask, _ = _batch(seed=6)

    def not_detached(logp, old_logp, advantages, mask, lo, hi):
        r = torch.exp(logp - old_logp)
        return -torch.clamp(r, max=1 + hi) * advantages * logp * mask, {}

    def lower_bound(logp, old_logp, advantages, mask, lo, hi):
        r = torch.exp(logp - old_logp).detach()
        return -torch.clamp(r, 1 - lo, 1 + hi) * advantages * logp * mask, {}

    def ppo(logp, old_logp, advantages, mask, lo, hi):
        return policy_loss(logp, old_logp, advantages, mask, lo, hi)
    assert _cispo_matches(cispo_loss, logp, old, adv, mask, 0.2)
    for wrong in (not_detached, lower_bound, ppo):
        assert not _cispo_matches(wrong, logp, old, adv, mask, 0.2), wrong.__name__


def test_cispo_without_a_clip_is_m2pos_masked_ratio_gradient():
    """Under algo.m2po_tau the clip is (inf, inf): CISPO's gradient is then that of M * r * A."""
    logp, old, adv, mask, _ = _batch(seed=7)
    a, b = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    per_token, _ = cispo_loss(a, old, adv, mask, math.inf, math.inf)
    per_token.sum().backward()
    (-(torch.exp(b - old) * adv) * mask).sum().backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-6)


# ----------------------------------------------------------------------------- advantages
def test_rloo_by_hand_and_against_the_papers_sum():
    """Group (1, 0, 0, 1): A_0 = 1 - (0 + 0 + 1) / 3 = 2/3, A_1 = 0 - 2/3; group (3, 1): +-2."""
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0])
    got = torch.cat([rloo_advantages(scores[:4], 4), rloo_advantages(scores[4:], 2)])
    assert torch.allclose(got, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 2.0, -2.0]))

    def paper(scores, n):   # arXiv 2402.14740 eq. 6: R_i - 1/(k-1) sum_{j != i} R_j
        return torch.tensor([float(scores[i]) - sum(float(scores[j]) for j in range(len(scores)) if j != i
                                                     and j // n == i // n) / (n - 1) for i in range(len(scores))])
    gen = torch.Generator().manual_seed(0)
    r = torch.rand(12, generator=gen)
    assert torch.allclose(rloo_advantages(r, 4), paper(r, 4), atol=1e-6)
    # a wrong variant (the plain group mean, GRPO without std) fails the same check
    assert not torch.allclose(group_normalized_advantages(r, 4, std_normalize=False), paper(r, 4), atol=1e-6)
    with pytest.raises(ValueError, match="groups of at least 2"):
        rloo_advantages(r, 1)


def test_reinforce_pp_baseline_by_hand():
    """Groups (1, 0) and (1, 1), responses of 2, 1, 1, 1 tokens: centred 0.5, -0.5, 0, 0; on the
    tokens 0.5, 0.5, -0.5, 0, 0: mean 0.1, std sqrt(0.14); whitened (x - 0.1) / sqrt(0.14)."""
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    got = reinforce_pp_baseline_advantages(scores, mask, 2)
    std = math.sqrt(0.14 + 1e-8)
    want = torch.tensor([[0.4, 0.4], [-0.6, 0.0], [-0.1, 0.0], [-0.1, 0.0]]) / std
    assert torch.allclose(got, want, atol=1e-6)

    def paper(scores, mask, n):   # arXiv 2501.03262: r - mean_group(r), then batch (token) normalisation
        centred = torch.stack([scores[i] - scores[i // n * n:(i // n + 1) * n].mean() for i in range(len(scores))])
        x = centred[:, None].expand_as(mask)[mask.bool()]
        return (centred[:, None] - x.mean()) / torch.sqrt(x.var(unbiased=False) + 1e-8) * mask
    assert torch.allclose(got, paper(scores, mask, 2), atol=1e-6)
    # a wrong variant (GRPO's per-group std instead of the batch's) fails the same check
    grpo = group_normalized_advantages(scores, 2)[:, None] * mask
    assert not torch.allclose(grpo, paper(scores, mask, 2), atol=1e-6)


def test_reinforce_pp_by_hand():
    """Scores 1 and 0 on responses of 2 and 1 tokens, KL 0.1 on each token, kl_coef 1, gamma 1:
    per-token rewards (-0.1, 0.9) and (-0.1); returns (0.8, 0.9) and (-0.1); on the three tokens
    mean 0.5333, whitened (x - mean) / sqrt(var + 1e-8). A wrong variant (the score on every
    token, no returns: GRPO-like without a group) fails the same check."""
    scores = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    kl = torch.full((2, 2), 0.1)
    est = ADVANTAGES.get("reinforce_plus_plus")
    assert not est.needs_critic
    got, ret = est.fn(scores, kl, mask, None, AlgoConfig(name="reinforce_plus_plus", kl_coef=1.0), 2)
    assert ret is None
    x = torch.tensor([0.8, 0.9, -0.1])
    want = (torch.tensor([[0.8, 0.9], [-0.1, 0.0]]) - x.mean()) / torch.sqrt(x.var(unbiased=False) + 1e-8) * mask
    assert torch.allclose(got, want, atol=1e-6)

    def paper(rewards, mask, gamma):   # arXiv 2501.03262 sec. 3: discounted returns, batch-normalised
        returns = torch.zeros_like(rewards)
        for i in range(rewards.shape[0]):
            for t in range(rewards.shape[1]):
                returns[i, t] = sum(gamma ** (s - t) * rewards[i, s] for s in range(t, rewards.shape[1]))
        x = returns[mask.bool()]
        return (returns - x.mean()) / torch.sqrt(x.var(unbiased=False) + 1e-8) * mask
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(4, 5, generator=gen)
    m = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0, 0.0, 1.0, 1.0, 0.0], [1.0] + [0.0] * 4])
    rewards = rewards * m
    for gamma in (1.0, 0.9):
        assert torch.allclose(reinforce_pp_advantages(rewards, m, gamma), paper(rewards, m, gamma), atol=1e-5)
    wrong = masked_whiten(rewards.sum(1, keepdim=True) * m, m)   # the score on every token, no returns
    assert not torch.allclose(wrong, paper(rewards, m, 1.0), atol=1e-5)


def test_new_estimators_are_registered_without_a_critic_and_read_the_kl_in_the_reward():
    scores, mask = torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.ones(4, 2)
    kl = torch.tensor([[0.1, 0.1], [0.0, 0.0], [0.2, 0.0], [0.0, 0.0]])
    for name in ("rloo", "reinforce_plus_plus_baseline"):
        est = ADVANTAGES.get(name)
        assert not est.needs_critic
        plain, ret = est.fn(scores, kl, mask, None, AlgoConfig(name=name), 2)
        assert ret is None
        penalised, _ = est.fn(scores, kl, mask, None, AlgoConfig(name=name, kl_coef=1.0), 2)
        assert not torch.allclose(plain, penalised)
    adv, _ = ADVANTAGES.get("rloo").fn(scores, kl, mask, None, AlgoConfig(name="rloo", kl_coef=1.0), 2)
    assert torch.allclose(adv[:, 0], torch.tensor([0.8, -0.8, -0.2, 0.2]))   # (1 - 0.2) - 0; (0.5 - 0.2) - 0.5


# ------------------------------------------------------------------------ overlong, truncation
def _dapo_eq13(length: int, l_max: int, l_cache: int) -> float:
    """DAPO (arXiv 2503.14476) eq. 13, as written."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


def test_overlong_penalty_by_hand_and_against_the_paper():
    """L_max 10, buffer 4: free up to 6 tokens, then -penalty * (L - 6) / 4, -penalty from 10 on."""
    lengths = torch.tensor([5, 6, 7, 8, 10, 12])
    got = overlong_penalty(lengths, 10, 4, 0.5)
    assert torch.allclose(got, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]))
    for buf in (1, 3, 9):
        paper = torch.tensor([_dapo_eq13(int(n), 10, buf) for n in range(0, 14)])
        assert torch.allclose(overlong_penalty(torch.arange(14), 10, buf, 1.0), paper)
    wrong = -torch.clamp((torch.arange(14) - 6) / 10, 0, 1)   # divided by L_max, not the buffer
    assert not torch.allclose(wrong, torch.tensor([_dapo_eq13(n, 10, 4) for n in range(14)]))
    with pytest.raises(ValueError, match=r"reward\.overlong_buffer=10 must be in"):
        overlong_penalty(lengths, 10, 10, 1.0)


def _sample(n: int, stopped: bool, reward: float, group: int) -> Sample:
    return Sample([1, 2], list(range(3, 3 + n)), [-0.5] * n, [0] * n, stopped, group, reward=reward,
                  finish_reason="stop" if stopped else "length")


def test_the_step_shapes_scores_and_masks_truncated_rows():
    """max_new_tokens 8, buffer 4: 6 tokens lose 0.5 * 2/4; 8 (truncated) the whole 0.5. The
    truncated row leaves the mask: the token-mean loss equals that of the batch without it."""
    cfg = load_config(RECIPE, ["rollout.sampling.max_new_tokens=8", "reward.overlong_buffer=4",
                               "reward.overlong_penalty=0.5", "algo.mask_truncated=true"])
    samples = [_sample(3, True, 1.0, 0), _sample(6, True, 1.0, 0), _sample(8, False, 1.0, 0), _sample(2, True, 0.0, 0)]
    batch = build_batch(samples, 0)
    out, stats = shaped(cfg, batch)
    assert torch.allclose(out.scores, torch.tensor([1.0, 0.75, 0.5, 0.0]))
    assert torch.equal(out.resp_mask.sum(-1), torch.tensor([3.0, 6.0, 0.0, 2.0]))
    assert torch.isclose(stats["truncated_masked_frac"], torch.tensor(0.25))
    assert torch.isclose(stats["overlong_penalty_mean"], torch.tensor(-0.75 / 4))
    loss = torch.rand(out.resp_mask.shape, generator=torch.Generator().manual_seed(0))
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        masked = aggregate(loss, out.resp_mask, mode, global_normalizer(out.resp_mask, mode, 8))
        keep = [0, 1, 3]
        kept = build_batch([samples[i] for i in keep], 0).resp_mask
        filtered = aggregate(loss[keep, :kept.shape[1]], kept, mode, global_normalizer(kept, mode, 8))
        assert torch.allclose(masked, filtered), mode
    plain, none = shaped(load_config(RECIPE, []), batch)   # off by default: the batch as it came
    assert plain is batch and none == {}


# --------------------------------------------------------------------------- the settings
@pytest.mark.parametrize("overrides, match", [
    (["algo.policy_loss=dapo"], r"^algo\.policy_loss='dapo': unknown policy loss; use one of cispo, gspo, ppo"),
    (["algo.policy_loss=no_such_pkg.losses:fn"], r"^algo\.policy_loss='no_such_pkg\.losses:fn': no module named"),
    (["algo.policy_loss=cispo", "algo.clip_low=0.3"],
     r"^algo\.clip_low=0\.3: is not used with algo\.policy_loss=cispo"),
    (["algo.policy_loss=gspo", "algo.dual_clip=3"], r"^algo\.dual_clip=3\.0: is not used with algo\.policy_loss=gspo"),
    (["algo.policy_loss=gspo", "algo.bapo=true"], r"^algo\.bapo=True: adapts PPO's token clip"),
    (["algo.policy_loss=cispo", "algo.bapo=true"], r"^algo\.bapo=True: adapts PPO's token clip"),
    (["algo.policy_loss=gspo", "algo.m2po_tau=0.04"], r"^algo\.m2po_tau=0\.04: masks tokens"),
    (["reward.overlong_buffer=56"], r"^reward\.overlong_buffer=56: must be below rollout\.sampling\.max_new_tokens=56"),
    (["reward.overlong_buffer=-1"], r"^reward\.overlong_buffer=-1: must be >= 0"),
    (["reward.overlong_penalty=0.5"], r"^reward\.overlong_penalty=0\.5: is not used with reward\.overlong_buffer=0"),
    (["algo.name=rloo", "rollout.sampling.n=1"], r"^rollout\.sampling\.n=1: algo\.name=rloo compares"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_settings_are_refused_with_one_line(overrides, match):
    with pytest.raises(ConfigError) as err:
        load_config(RECIPE, overrides)
    assert _one_line(err)
    assert re.search(match, str(err.value)), str(err.value)


def test_good_settings_load():
    cfg = load_config(RECIPE, ["algo.name=rloo", "algo.policy_loss=cispo", "algo.clip_high=4.0",
                               "algo.mask_truncated=true", "reward.overlong_buffer=16", "reward.overlong_penalty=0.5"])
    assert (cfg.algo.policy_loss, cfg.reward.overlong_buffer) == ("cispo", 16)
    cfg = load_config(RECIPE, ["algo.name=reinforce_plus_plus_baseline", "algo.policy_loss=gspo",
                               "algo.clip_low=3e-4", "algo.clip_high=4e-4", "algo.loss_agg=seq-mean-token-mean"])
    assert cfg.algo.clip_high == 4e-4
    assert load_config(RECIPE, ["algo.policy_loss=cispo", "algo.m2po_tau=0.04"]).algo.m2po_tau == 0.04


def test_a_policy_loss_by_import_path_is_checked_and_reached(tmp_path):
    good = tmp_path / "my_loss.py"
    good.write_text("def loss(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip, is_weights):\n"
                    "    return -(logp * advantages) * mask, {}\n"
                    "def bad(logp, old_logp):\n    return logp, {}\n")
    cfg = load_config(RECIPE, [f"algo.policy_loss={good}:loss"])
    fn = POLICY_LOSSES.get(cfg.algo.policy_loss)
    assert torch.equal(fn(torch.ones(1, 2), None, torch.ones(1, 2), torch.ones(1, 2), 0.2, 0.2, None, None)[0],
                       -torch.ones(1, 2))
    with pytest.raises(ConfigError) as err:
        load_config(RECIPE, [f"algo.policy_loss={good}:bad"])
    assert _one_line(err).startswith(f"algo.policy_loss='{good}:bad': has the signature")


def test_approx_kl_is_reported_alike_by_every_loss():
    logp, old, adv, mask, _ = _batch(seed=8)
    want = masked_mean(kl_penalty(old, logp, "k3"), mask)
    for fn in (policy_loss, gspo_loss, cispo_loss):
        assert torch.equal(fn(logp, old, adv, mask, 0.2, 0.2)[1]["approx_kl"], want)
