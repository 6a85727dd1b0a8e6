"""The stale-data stabilizers' maths (issue 21): M2PO's token mask, BAPO's adaptive clip bounds
and gradient-alignment control, on small tensors with expected values worked out by hand."""
import math

import pytest
import torch

from megarl.ppo.stabilizers import alignment, bapo_bounds, m2po_keep, positive_share, project


def floats(stats: dict) -> dict:
    return {k: float(v) for k, v in stats.items()}


# ------------------------------------------------------------------------------------- M2PO

# Squares 4, 1, 0.25, 0.01 (sum 5.26, M2 = 1.315); the last two positions are padding holding
# garbage. Removing the largest leaves 1.26 / 3 = 0.42; the two largest 0.26 / 2 = 0.13; the
# three largest 0.01.
LOG_RATIO = torch.tensor([[2.0, -1.0, 0.5, -0.1, math.inf, math.nan]])
MASK = torch.tensor([[1.0, 1, 1, 1, 0, 0]])


@pytest.mark.parametrize("tau, keep, m2_kept", [
    (0.5, [0, 1, 1, 1], 0.42),     # 1.315 > 0.5, 0.42 <= 0.5: one removed
    (0.2, [0, 0, 1, 1], 0.13),     # 0.42 > 0.2, 0.13 <= 0.2: two removed
    (0.13, [0, 0, 1, 1], 0.13),    # the bound itself is within
    (0.05, [0, 0, 0, 1], 0.01),    # 0.13 > 0.05: three removed
])
def test_m2po_removes_the_largest_squares_until_the_mean_is_within_tau(tau, keep, m2_kept):
    got, stats = m2po_keep(LOG_RATIO, MASK, tau)
    assert got.tolist() == [keep + [0.0, 0.0]]
    removed = 4 - sum(keep)
    assert floats(stats) == pytest.approx({"m2po_m2": 1.315, "m2po_m2_kept": m2_kept,
                                           "m2po_masked_frac": removed / 4}, rel=1e-5)


def test_m2po_ignores_garbage_in_padding():
    clean = torch.where(MASK.bool(), LOG_RATIO, 0.0)
    a, sa = m2po_keep(LOG_RATIO, MASK, 0.5)
    b, sb = m2po_keep(clean, MASK, 0.5)
    assert torch.equal(a, b) and floats(sa) == floats(sb)
    assert all(math.isfinite(v) for v in floats(sa).values())


def test_m2po_removes_nothing_when_the_batch_is_within_tau():
    # No token above the bound.
    got, stats = m2po_keep(torch.tensor([[0.1, -0.2, 0.3]]), torch.ones(1, 3), 0.5)
    assert got.tolist() == [[1.0, 1.0, 1.0]] and float(stats["m2po_masked_frac"]) == 0.0
    # One token above tau on its own (4 > 1.5), but M2 = 1.315 <= 1.5: the bound is on the mean.
    got, stats = m2po_keep(LOG_RATIO, MASK, 1.5)
    assert got.tolist() == [[1.0, 1, 1, 1, 0, 0]]
    assert float(stats["m2po_m2_kept"]) == pytest.approx(1.315)


def test_m2po_equal_tokens_are_all_removed_or_all_kept():
    # Squares all 1 > 0.5: removing some leaves a mean of 1, so every token goes.
    got, stats = m2po_keep(torch.tensor([[1.0, -1.0, 1.0]]), torch.ones(1, 3), 0.5)
    assert got.tolist() == [[0.0, 0.0, 0.0]]
    assert floats(stats) == {"m2po_m2": 1.0, "m2po_m2_kept": 0.0, "m2po_masked_frac": 1.0}
    # Squares all 0.25 <= 0.3: none goes.
    got, _ = m2po_keep(torch.tensor([[0.5, -0.5]]), torch.ones(1, 2), 0.3)
    assert got.tolist() == [[1.0, 1.0]]


def test_m2po_ties_are_removed_in_flat_index_order():
    # Squares, flat: 0 1 4 | 1 0 0 (M2 = 6 / 6 = 1). Without the 4: 2 / 5 = 0.4 > 0.3; without
    # the 4 and one 1: 1 / 4 = 0.25 <= 0.3. The two 1s tie: the lower flat index (row 0) goes.
    log_ratio = torch.tensor([[0.0, 1.0, 2.0], [-1.0, 0.0, 0.0]])
    first, stats = m2po_keep(log_ratio, torch.ones(2, 3), 0.3)
    assert first.tolist() == [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    assert floats(stats) == pytest.approx({"m2po_m2": 1.0, "m2po_m2_kept": 0.25, "m2po_masked_frac": 2 / 6})
    for _ in range(3):
        assert torch.equal(m2po_keep(log_ratio, torch.ones(2, 3), 0.3)[0], first)


def test_m2po_ties_order_holds_on_a_large_batch():
    # 1000 squares of 1 at random places among 3000 tokens, the rest 0: M2 = 1/3. Removing k of
    # the 1s leaves (1000 - k) / (3000 - k) <= 0.2 from k = 500 on, so exactly the first 500 1s
    # by flat index go (large enough that an unstable sort would reorder the ties).
    gen = torch.Generator().manual_seed(0)
    ones = torch.randperm(3000, generator=gen)[:1000]
    log_ratio = torch.zeros(3000)
    log_ratio[ones] = torch.where(torch.rand(1000, generator=gen) < 0.5, 1.0, -1.0)
    keep, stats = m2po_keep(log_ratio.view(30, 100), torch.ones(30, 100), 0.2)
    removed = (keep.flatten() == 0).nonzero().flatten()
    assert torch.equal(removed, ones.sort().values[:500])
    assert float(stats["m2po_m2_kept"]) == pytest.approx(500 / 2500)


def test_m2po_removes_a_nan_response_token_first():
    keep, stats = m2po_keep(torch.tensor([[math.nan, 0.1, 0.2]]), torch.ones(1, 3), 0.5)
    assert keep.tolist() == [[0.0, 1.0, 1.0]]
    assert float(stats["m2po_m2"]) == math.inf      # the stat shows the garbage, not nan
    assert float(stats["m2po_m2_kept"]) == pytest.approx((0.01 + 0.04) / 2)


@pytest.mark.parametrize("seed", range(6))
def test_m2po_removes_the_fewest_largest_tokens(seed):
    """Against the definition written as a loop: k = the smallest count of largest squares whose
    removal brings the rest's mean to <= tau (n when none does)."""
    gen = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(4, 9, generator=gen) * 0.4
    mask = (torch.rand(4, 9, generator=gen) < 0.7).float()
    tau = 0.02 + 0.1 * seed / 5
    sq = sorted((log_ratio[mask.bool()] ** 2).tolist(), reverse=True)
    k = next((k for k in range(len(sq)) if sum(sq[k:]) / len(sq[k:]) <= tau), len(sq))
    keep, _ = m2po_keep(log_ratio, mask, tau)
    assert int(mask.sum() - keep.sum()) == k
    assert float((keep * (1 - mask)).sum()) == 0.0
    if k:
        kept_max = float((log_ratio**2 * keep).max())
        assert all(v >= kept_max for v in sq[:k])


@pytest.mark.parametrize("tau", [0.0, -0.1, math.nan])
def test_m2po_tau_must_be_positive(tau):
    with pytest.raises(ValueError, match="algo.m2po_tau"):
        m2po_keep(LOG_RATIO, MASK, tau)


# ------------------------------------------------------------------------------------- BAPO

# Six tokens and one padded position (garbage), under the default start bounds [0.6, 1.2]:
#   r    A   w    carries?                    contribution w * r * |A|
#   1.0  +1  1    yes (r <= 1.2)              1.0
#   1.5  +2  1    no  (r > 1.2, clipped)      (3.0 once c_high >= 1.5)
#   0.5  -1  1    no  (r < 0.6, clipped)      (0.5 while c_low <= 0.5)
#   0.8  -1  0.5  yes (r >= 0.6)              0.4 (0 once c_low > 0.8)
#   2.0   0  1    A == 0: nothing
#   1.1  -2  1    yes                         2.2
SIX = dict(
    ratio=torch.tensor([[1.0, 1.5, 0.5, 0.8, 2.0, 1.1, math.inf]]),
    advantages=torch.tensor([[1.0, 2.0, -1.0, -1.0, 0.0, -2.0, math.nan]]),
    mask=torch.tensor([[1.0, 1, 1, 1, 1, 1, 0]]),
    weights=torch.tensor([[1.0, 1, 1, 0.5, 1, 1, math.nan]]),
)


@pytest.mark.parametrize("c_low, c_high, share", [
    (0.6, 1.2, 1.0 / (1.0 + 0.4 + 2.2)),           # 0.2778
    (0.6, 1.5, (1.0 + 3.0) / (4.0 + 0.4 + 2.2)),   # r == c_high carries: 0.6061
    (0.9, 1.2, 1.0 / (1.0 + 2.2)),                 # the 0.8 negative stops carrying: 0.3125
    (0.4, 1.2, 1.0 / (1.0 + 0.5 + 0.4 + 2.2)),     # the 0.5 negative carries too: 0.2439
])
def test_positive_share_by_hand(c_low, c_high, share):
    assert float(positive_share(**SIX, c_low=c_low, c_high=c_high)) == pytest.approx(share, rel=1e-6)


def test_positive_share_is_one_when_nothing_carries():
    only_clipped_negative = dict(ratio=torch.tensor([[0.3]]), advantages=torch.tensor([[-1.0]]),
                                 mask=torch.ones(1, 1), weights=torch.ones(1, 1))
    assert float(positive_share(**only_clipped_negative, c_low=0.6, c_high=1.2)) == 1.0
    empty = {**only_clipped_negative, "mask": torch.zeros(1, 1)}
    assert float(positive_share(**empty, c_low=0.6, c_high=1.2)) == 1.0


# A grid small enough to walk by hand: c_low in 0.6, 0.65, 0.7; c_high in 1.2, 1.3, 1.4.
#   r     A   carries                       contribution
#   1.0   +1  always                        1.0
#   1.35  +1  once c_high = 1.4             1.35
#   0.62  -1  while c_low = 0.6             0.62
#   1.0   -2  always                        2.0
# Path and share: (0.6, 1.2) 1 / 3.62 = 0.2762; (0.6, 1.3) the same; (0.6, 1.4) 2.35 / 4.97 =
# 0.4728; (0.65, 1.4) 2.35 / 4.35 = 0.5402; (0.7, 1.4) the same.
GRID = dict(
    ratio=torch.tensor([[1.0, 1.35, 0.62, 1.0]]),
    advantages=torch.tensor([[1.0, 1.0, -1.0, -2.0]]),
    mask=torch.ones(1, 4),
    weights=torch.ones(1, 4),
)
GRID_SETTINGS = dict(low=(0.6, 0.7), high=(1.2, 1.4), steps=(0.05, 0.1))


@pytest.mark.parametrize("rho, c_low, c_high, share", [
    (0.2, 0.6, 1.2, 1 / 3.62),      # already satisfied: the start bounds
    (0.45, 0.6, 1.4, 2.35 / 4.97),  # c_high moves first, two steps up to its limit
    (0.5, 0.65, 1.4, 2.35 / 4.35),  # then c_low, one step
    (0.6, 0.7, 1.4, 2.35 / 4.35),   # cannot be satisfied: ends at both limits
])
def test_bapo_bounds_walk_c_high_then_c_low(rho, c_low, c_high, share):
    lo, hi, stats = bapo_bounds(**GRID, rho=rho, **GRID_SETTINGS)
    assert (lo, hi) == (pytest.approx(c_low), pytest.approx(c_high))
    assert lo <= 0.7 and hi <= 1.4       # never past a limit by float error
    assert floats(stats) == pytest.approx({"bapo_low": c_low, "bapo_high": c_high,
                                           "bapo_share_start": 1 / 3.62, "bapo_share": share}, rel=1e-6)


def test_bapo_default_limits_are_reached_exactly():
    # Only negative tokens: the share stays 0, the loop runs to the limits: 0.6 + 15 * 0.02 = 0.9
    # and 1.2 + 36 * 0.05 = 3.0 must both be reachable despite float error.
    data = dict(ratio=torch.full((2, 3), 1.0), advantages=torch.full((2, 3), -1.0),
                mask=torch.ones(2, 3), weights=torch.ones(2, 3))
    lo, hi, stats = bapo_bounds(**data, rho=0.4)
    assert (lo, hi) == (pytest.approx(0.9), pytest.approx(3.0))
    assert float(stats["bapo_share"]) == 0.0


def test_bapo_c_low_without_room_freezes_both_bounds():
    # The paper's loop runs only while c_low can take a step, c_high's moves included.
    lo, hi, _ = bapo_bounds(**GRID, rho=0.6, low=(0.6, 0.6), high=(1.2, 1.4), steps=(0.05, 0.1))
    assert (lo, hi) == (0.6, 1.2)


def reference_loop(data: dict, rho, low, high, steps) -> tuple[float, float, list[float]]:
    """The paper's Algorithm written plainly, on positive_share; returns the shares it saw."""
    c_low, c_high = low[0], high[0]
    seen = [float(positive_share(**data, c_low=c_low, c_high=c_high))]
    while seen[-1] < rho and c_low + steps[0] <= low[1] + 1e-9:
        if c_high + steps[1] <= high[1] + 1e-9:
            c_high += steps[1]
        else:
            c_low += steps[0]
        seen.append(float(positive_share(**data, c_low=c_low, c_high=c_high)))
    return c_low, c_high, seen


@pytest.mark.parametrize("seed", range(8))
def test_bapo_matches_the_loop_and_never_lowers_the_share(seed):
    gen = torch.Generator().manual_seed(seed)
    data = dict(ratio=torch.exp(torch.randn(8, 16, generator=gen) * 0.6),
                advantages=torch.randn(8, 16, generator=gen),
                mask=(torch.rand(8, 16, generator=gen) < 0.8).float(),
                weights=torch.rand(8, 16, generator=gen) * 2)
    rho = 0.3 + 0.05 * seed
    lo, hi, stats = bapo_bounds(**data, rho=rho)
    ref_lo, ref_hi, seen = reference_loop(data, rho, (0.6, 0.9), (1.2, 3.0), (0.02, 0.05))
    assert (lo, hi) == (pytest.approx(ref_lo), pytest.approx(ref_hi))
    assert all(b >= a - 1e-7 for a, b in zip(seen, seen[1:]))
    assert float(stats["bapo_share"]) >= float(stats["bapo_share_start"]) - 1e-7
    assert float(stats["bapo_share"]) == pytest.approx(seen[-1], rel=1e-6)


@pytest.mark.parametrize("key, kwargs", [
    ("algo.bapo_rho", dict(rho=0.0)),
    ("algo.bapo_rho", dict(rho=1.0)),
    ("algo.bapo_low", dict(low=(0.9, 0.6))),
    ("algo.bapo_low", dict(low=(0.0, 0.9))),
    ("algo.bapo_low", dict(low=(0.6, 1.0))),
    ("algo.bapo_high", dict(high=(1.0, 3.0))),
    ("algo.bapo_high", dict(high=(3.0, 1.2))),
    ("algo.bapo_steps", dict(steps=(0.0, 0.05))),
    ("algo.bapo_steps", dict(steps=(0.02, -0.05))),
])
def test_bapo_bad_settings_raise(key, kwargs):
    with pytest.raises(ValueError, match=key):
        bapo_bounds(**GRID, **{"rho": 0.4, **kwargs})


# -------------------------------------------------------------------------------------- GAC


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def test_alignment_cosine_and_coefficient_by_hand():
    # g = [1, 1], p = [1, 0]: dot 1, |g|^2 2, |p|^2 1, cos = 1 / sqrt(2). At threshold 0.5:
    # a = 1, |g_perp| = 1, a* = 0.5 / sqrt(0.75) = 1 / sqrt(3), coef = 1 - 1 / sqrt(3).
    cos, coef = alignment(1.0, 2.0, 1.0, 0.5)
    assert cos == pytest.approx(1 / math.sqrt(2)) and coef == pytest.approx(1 - 1 / math.sqrt(3))
    # p = [2, 0]: same direction, coef halves so that coef * p is the same vector.
    cos, coef = alignment(2.0, 2.0, 4.0, 0.5)
    assert cos == pytest.approx(1 / math.sqrt(2)) and coef == pytest.approx((1 - 1 / math.sqrt(3)) / 2)


@pytest.mark.parametrize("seed", range(5))
def test_project_brings_the_cosine_to_the_threshold_and_keeps_the_orthogonal_part(seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(7, generator=gen, dtype=torch.float64)
    g = 3.0 * p + torch.randn(7, generator=gen, dtype=torch.float64)   # strongly aligned
    threshold = 0.1 + 0.15 * seed
    before = cosine(g, p)
    assert before > threshold
    out, cos = project(g, p, threshold)
    assert cos == pytest.approx(before)
    assert cosine(out, p) == pytest.approx(threshold, abs=1e-6)
    u = p / p.norm()
    assert torch.allclose(out - (out @ u) * u, g - (g @ u) * u, atol=1e-9)


def test_project_at_threshold_zero_leaves_only_the_orthogonal_part():
    out, _ = project(torch.tensor([1.0, 1.0]), torch.tensor([2.0, 0.0]), 0.0)
    assert torch.allclose(out, torch.tensor([0.0, 1.0]), atol=1e-6)


@pytest.mark.parametrize("g, p", [
    ([0.5, 1.0], [1.0, 0.0]),     # cos 0.447 <= 0.5: below the threshold
    ([-1.0, 0.5], [1.0, 0.0]),    # anti-aligned
    ([0.0, 1.0], [1.0, 0.0]),     # orthogonal
])
def test_project_leaves_a_gradient_within_the_threshold(g, p):
    g, p = torch.tensor(g), torch.tensor(p)
    out, cos = project(g, p, 0.5)
    assert torch.equal(out, g) and cos == pytest.approx(cosine(g, p))


@pytest.mark.parametrize("g, p", [([0.0, 0.0], [1.0, 2.0]), ([1.0, 2.0], [0.0, 0.0])])
def test_zero_gradients_have_cosine_zero_and_are_unchanged(g, p):
    g, p = torch.tensor(g), torch.tensor(p)
    out, cos = project(g, p, 0.3)
    assert cos == 0.0 and torch.equal(out, g)
    assert alignment(float(g @ p), float(g @ g), float(p @ p), 0.3) == (0.0, 0.0)


@pytest.mark.parametrize("threshold", [1.0, -0.1, 1.5, math.nan])
def test_alignment_threshold_must_be_a_cosine_below_one(threshold):
    with pytest.raises(ValueError, match="algo.grad_align_threshold"):
        alignment(1.0, 2.0, 1.0, threshold)
