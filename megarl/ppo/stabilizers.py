"""Stale-data stabilizers as pure functions: M2PO's token mask, BAPO's adaptive clip bounds and
gradient-alignment control (GAC).

Each one answers a question about the data or the gradient and leaves the update step to act
on the answer: which tokens the loss keeps (M2PO), which ratio bounds the loss clips to (BAPO),
how much of the previous update's direction the gradient loses (GAC). Tensors are [B, T] with
a 0/1 float mask as in `megarl.ppo.losses`; stats are detached 0-d tensors. The settings are
`algo.m2po_tau`, `algo.bapo_*` and `algo.grad_align*` (megarl/config/schema/).
"""

import math

import torch
from torch import Tensor

from megarl.ppo.losses import masked_mean

# Comparisons of a stepped bound with its limit allow this much float error, so that
# 0.6 + 15 * 0.02 still reaches a limit of 0.9.
BOUND_EPS = 1e-9


# ---------------------------------------------------------------------------------------------
# M2PO (Zheng et al. 2025, arXiv 2510.01161)
# ---------------------------------------------------------------------------------------------


@torch.no_grad()  # the mask selects tokens; no gradient flows through the choice
def m2po_keep(log_ratio: Tensor, mask: Tensor, tau: float) -> tuple[Tensor, dict[str, Tensor]]:
    """M2PO's second-moment mask: drop the most off-policy tokens until the rest's M2 <= tau.

    M2 is the mean over response tokens of log_ratio**2. The tokens with the largest squared log
    ratio are removed, largest first, the fewest that bring the mean over the remaining tokens to
    at most tau: none when M2 <= tau already (a token above tau on its own stays when the batch
    as a whole is within the bound), every token when no such number exists (e.g. all equal and
    above tau). Among equal values the lower flat index is removed first, so every rank computes
    the same mask from the same input.

    Args:
        log_ratio: [B, T] log(pi / pi_behaviour) per token; padded positions may hold inf/nan.
        mask: [B, T] 1 on response tokens.
        tau: the bound on the kept tokens' M2 (algo.m2po_tau), > 0.

    Returns:
        (keep [B, T], 1.0 kept, 0.0 removed or padding; stats) with m2po_m2 (M2 of all response
        tokens), m2po_m2_kept (of the kept ones, 0 when none is kept) and m2po_masked_frac
        (removed / response tokens). A response token whose log ratio is nan counts as the
        largest value, so it is removed first.
    """
    if not tau > 0:
        raise ValueError(f"algo.m2po_tau={tau!r}: must be > 0 (the paper uses 0.04), or null to disable M2PO")
    valid = mask.bool()
    # where, not multiply: padded positions may hold inf/nan and inf * 0 is nan.
    sq = torch.where(valid, log_ratio.float(), 0.0).square()
    sq = torch.nan_to_num(sq, nan=math.inf)
    flat_sq, flat_valid = sq.flatten(), valid.flatten()
    # Squares are >= 0, so -1 sorts padding after every response token; stable keeps flat order.
    order = torch.sort(torch.where(flat_valid, flat_sq, -1.0), descending=True, stable=True).indices
    kept_sorted = _kept_in_removal_order(flat_sq[order], flat_valid[order], tau)
    keep_dtype = mask.dtype if mask.is_floating_point() else torch.float32
    keep = torch.zeros_like(flat_sq).scatter(0, order, kept_sorted.float()).view_as(sq).to(keep_dtype)
    stats = {
        "m2po_m2": masked_mean(sq, mask),
        # where: a removed token's square may be inf, and inf * 0 is nan
        "m2po_m2_kept": masked_mean(torch.where(keep.bool(), sq, 0.0), keep),
        "m2po_masked_frac": masked_mean(1.0 - keep, mask),
    }
    return keep, stats


def _kept_in_removal_order(values: Tensor, valid: Tensor, tau: float) -> Tensor:
    """Which of the sorted tokens M2PO keeps: values [N] in removal order (largest first, padding
    last, valid [N] False there). Removing the k largest leaves the n - k smallest; their mean
    grows with n - k, so the kept tokens are the longest run of smallest values whose mean is
    <= tau. Cumulative sums from the small end give every such mean at once; summing from that
    end also keeps an inf among the largest values out of the sums of the smaller ones."""
    asc_values, asc_valid = values.flip(0), valid.flip(0)
    sums = torch.cumsum(torch.where(asc_valid, asc_values, 0.0), 0)
    counts = torch.cumsum(asc_valid.to(sums.dtype), 0)
    within = ~asc_valid | (sums / counts.clamp_min(1) <= tau)
    run = torch.cumsum((~within).to(torch.int32), 0) == 0   # no failing prefix up to here
    return (run & asc_valid).flip(0)


# ---------------------------------------------------------------------------------------------
# BAPO (Xi et al. 2025, arXiv 2510.18927)
# ---------------------------------------------------------------------------------------------


def positive_share(
    ratio: Tensor, advantages: Tensor, mask: Tensor, weights: Tensor, c_low: float, c_high: float
) -> Tensor:
    """The positive-advantage tokens' share of the gradient-carrying contribution under the
    ratio bounds [c_low, c_high] (BAPO's balance quantity, in this module's reading).

    A token carries gradient when the PPO clipped branch is not active for it: for A > 0 when
    r <= c_high, for A < 0 when r >= c_low; A == 0 contributes nothing. Its contribution is
    weights * r * |A|. The share is the carrying positive tokens' sum over all carrying tokens'
    sum; when nothing carries it is 1.0: no negative token dominates the gradient, so the
    balance BAPO asks for holds.

    Why this reading: the paper's literal "absolute clipped-surrogate contribution" counts the
    clipped negative tokens at c_low * |A|, so raising c_low would lower the positive share,
    while the paper's stated intent is to stop low-probability negative tokens dominating the
    gradient. Counting only gradient-carrying tokens makes both of the algorithm's moves raise
    the share: raising c_high lets positives with r > c_high carry again, raising c_low stops
    negatives with r < c_low from carrying.

    Args:
        ratio: [B, T] pi / pi_old; advantages, mask: [B, T]; weights: [B, T] the behaviour IS
            weights the loss multiplies by (or ones), >= 0. Padded positions may hold garbage.
        c_low, c_high: explicit ratio bounds (the loss clips r to [c_low, c_high]).

    Returns:
        The share, a detached 0-d float tensor in [0, 1].
    """
    is_pos, is_neg, contrib = _bapo_parts(ratio, advantages, mask, weights)
    return _share(_positive_sum(contrib, ratio, is_pos, c_high), _negative_sum(contrib, ratio, is_neg, c_low))


@torch.no_grad()
def bapo_bounds(
    ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weights: Tensor,
    rho: float,
    low: tuple[float, float] = (0.6, 0.9),
    high: tuple[float, float] = (1.2, 3.0),
    steps: tuple[float, float] = (0.02, 0.05),
) -> tuple[float, float, dict[str, Tensor]]:
    """BAPO's per-batch clip bounds: the paper's Algorithm, on `positive_share`.

    Start at c_low, c_high = low[0], high[0]; while the share is below rho and c_low can still
    take a step (c_low + steps[0] <= low[1]): raise c_high by steps[1] while it stays within
    high[1], else raise c_low by steps[0]. As in the paper the loop's condition is on c_low, so
    with low[0] == low[1] neither bound moves. Every move raises the share or leaves it (see
    `positive_share`), so the loop stops at the first bounds along this fixed path that reach
    rho, or at its end.

    The share at a bound pair splits into a positive sum that depends on c_high alone and a
    negative sum that depends on c_low alone; both are computed for every bound on the path
    and read back in one device-to-host copy, rather than one per iteration.

    Args:
        ratio, advantages, mask, weights: [B, T] as `positive_share` takes them.
        rho: the share to reach (algo.bapo_rho), in (0, 1).
        low, high: (start, limit) of c_low and c_high (algo.bapo_low, algo.bapo_high).
        steps: (c_low increment, c_high increment) (algo.bapo_steps).

    Returns:
        (c_low, c_high, stats) with the bounds as python floats and stats bapo_low, bapo_high,
        bapo_share_start (the share at the start bounds) and bapo_share (at the returned ones).
    """
    _check_bapo(rho, low, high, steps)
    lows = _stepped(low[0], low[1], steps[0])
    highs = _stepped(high[0], high[1], steps[1])
    path = _bapo_path(len(lows), len(highs))
    is_pos, is_neg, contrib = _bapo_parts(ratio, advantages, mask, weights)
    pos = torch.stack([_positive_sum(contrib, ratio, is_pos, c) for c in highs])
    neg = torch.stack([_negative_sum(contrib, ratio, is_neg, c) for c in lows])
    i_low = torch.tensor([i for i, _ in path], device=pos.device)
    i_high = torch.tensor([j for _, j in path], device=pos.device)
    shares = _share(pos[i_high], neg[i_low])
    at = next((n for n, s in enumerate(shares.tolist()) if not s < rho), len(path) - 1)
    c_low, c_high = lows[path[at][0]], highs[path[at][1]]
    stats = {
        "bapo_low": torch.tensor(c_low, device=pos.device),
        "bapo_high": torch.tensor(c_high, device=pos.device),
        "bapo_share_start": shares[0],
        "bapo_share": shares[at],
    }
    return c_low, c_high, stats


def _check_bapo(rho: float, low, high, steps) -> None:
    """The settings' own checks (megarl/config/schema/) repeated for direct callers."""
    if not 0 < rho < 1:
        raise ValueError(f"algo.bapo_rho={rho!r}: must be in (0, 1) (the paper uses 0.4)")
    if not 0 < low[0] <= low[1] < 1:
        raise ValueError(f"algo.bapo_low={list(low)!r}: needs 0 < start <= limit < 1 (e.g. [0.6, 0.9])")
    if not 1 < high[0] <= high[1]:
        raise ValueError(f"algo.bapo_high={list(high)!r}: needs 1 < start <= limit (e.g. [1.2, 3.0])")
    if not (steps[0] > 0 and steps[1] > 0):
        raise ValueError(f"algo.bapo_steps={list(steps)!r}: both increments must be > 0 (e.g. [0.02, 0.05])")


def _stepped(start: float, limit: float, step: float) -> list[float]:
    """start, start + step, ... up to limit (BOUND_EPS allowed): the values a bound can take.
    Each is start + n * step, not a running sum, and none exceeds limit by float error."""
    n = math.floor((limit - start + BOUND_EPS) / step)
    return [min(start + i * step, limit) for i in range(n + 1)]


def _bapo_path(n_low: int, n_high: int) -> list[tuple[int, int]]:
    """(c_low index, c_high index) in the order the paper's loop visits them: c_high up to its
    limit, then c_low up to its own; only the start when c_low cannot step (the loop's
    condition)."""
    if n_low == 1:
        return [(0, 0)]
    return [(0, j) for j in range(n_high)] + [(i, n_high - 1) for i in range(1, n_low)]


def _bapo_parts(ratio: Tensor, advantages: Tensor, mask: Tensor, weights: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(positive tokens, negative tokens, contribution weights * r * |A|), padding excluded."""
    valid = mask.bool()
    ratio, advantages = ratio.detach().float(), advantages.detach().float()
    # where, not multiply: padded positions may hold garbage and inf * 0 is nan.
    contrib = torch.where(valid, weights.detach().float() * ratio * advantages.abs(), 0.0)
    return valid & (advantages > 0), valid & (advantages < 0), contrib


def _positive_sum(contrib: Tensor, ratio: Tensor, is_pos: Tensor, c_high: float) -> Tensor:
    """Positive tokens carry gradient while r <= c_high (their clipped branch is r > c_high)."""
    return torch.where(is_pos & (ratio <= c_high), contrib, 0.0).sum()


def _negative_sum(contrib: Tensor, ratio: Tensor, is_neg: Tensor, c_low: float) -> Tensor:
    """Negative tokens carry gradient while r >= c_low (their clipped branch is r < c_low)."""
    return torch.where(is_neg & (ratio >= c_low), contrib, 0.0).sum()


def _share(pos: Tensor, neg: Tensor) -> Tensor:
    """pos / (pos + neg), 1.0 where nothing carries (see positive_share)."""
    total = pos + neg
    return torch.where(total > 0, pos / torch.where(total > 0, total, 1.0), 1.0)


# ---------------------------------------------------------------------------------------------
# Gradient-alignment control (GAC, Xu et al., arXiv 2603.01501)
# ---------------------------------------------------------------------------------------------


def alignment(dot: float, g_sq: float, p_sq: float, threshold: float) -> tuple[float, float]:
    """Cosine of the gradient with the previous update's gradient, and the projection coefficient.

    The paper's abstract defines the signal, a high cosine between consecutive policy gradients
    under asynchrony (stale data pushes the same direction again and again), and the remedy, a
    projection that limits progress along that stale-aligned direction. Its exact coefficients
    were not available; the reading here is this project's own: when the cosine exceeds the
    threshold, the component of g along u = p / |p| is shrunk so that the corrected gradient's
    cosine with p equals the threshold exactly, and the part orthogonal to p is left untouched:

        a = dot / |p|, |g_perp|^2 = max(g_sq - a^2, 0), a* = threshold * |g_perp| / sqrt(1 - threshold^2)
        g' = g - coef * p, coef = (a - a*) / |p|

    threshold 0 removes the aligned component entirely; a g parallel to p (no orthogonal part)
    becomes zero whatever the threshold.

    Args:
        dot: g . p; g_sq: |g|^2; p_sq: |p|^2, each already summed over every rank's shard.
        threshold: the largest cosine left in place (algo.grad_align_threshold), in [0, 1).

    Returns:
        (cos, coef): cos 0.0 when either norm is 0; coef 0.0 when cos <= threshold or a norm is 0.
    """
    if not 0 <= threshold < 1:
        raise ValueError(f"algo.grad_align_threshold={threshold!r}: must be in [0, 1) "
                         f"(a cosine; 0 removes the whole aligned component)")
    if g_sq <= 0 or p_sq <= 0:
        return 0.0, 0.0
    p_norm = math.sqrt(p_sq)
    cos = dot / (math.sqrt(g_sq) * p_norm)
    if cos <= threshold:
        return cos, 0.0
    along = dot / p_norm
    perp = math.sqrt(max(g_sq - along * along, 0.0))
    target = threshold * perp / math.sqrt(1.0 - threshold * threshold)
    return cos, (along - target) / p_norm


def project(g: Tensor, p: Tensor, threshold: float) -> tuple[Tensor, float]:
    """`alignment` applied to flat tensors: the reference definition (the distributed update
    calls `alignment` with all-reduced sums instead). Returns (g - coef * p, cos)."""
    g64, p64 = g.detach().double(), p.detach().double()
    cos, coef = alignment(float(g64 @ p64), float(g64 @ g64), float(p64 @ p64), threshold)
    return (g - coef * p if coef else g.clone()), cos
