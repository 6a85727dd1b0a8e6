"""is_masked_frac split by token age (issue 18, finding 9): async mode's one-version drift shows
apart from the train/inference mismatch of fresh tokens."""
import torch

from megarl.ppo.correction import behaviour_weights, masked_frac_by_age


def test_masked_fraction_is_reported_per_token_age():
    mask = torch.tensor([[1.0, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    versions = torch.tensor([[5, 5, 4, 4, 0], [3, 5, 5, 0, 0]])     # trained at step 5
    old = torch.zeros(2, 5)
    behav = torch.tensor([[0.0, 0, 0.0, -1.0, 0], [-1.0, 0, -1.0, 0, 0]])   # w = e^1 masked where behav=-1
    w, stats = behaviour_weights(old, behav, mask, "mask", "token", 2.0, 0.5, 2.0)
    got = {k: float(v) for k, v in masked_frac_by_age(w, mask, versions, 5).items()}
    assert got == {"is_masked_frac_age0": 0.25, "is_masked_frac_age1": 0.5, "is_masked_frac_age2plus": 1.0}
    assert abs(float(stats["is_masked_frac"]) - 3 / 7) < 1e-6


def test_no_tokens_of_an_age_reads_zero():
    mask = torch.ones(1, 3)
    got = masked_frac_by_age(torch.ones(1, 3), mask, torch.full((1, 3), 7), 7)
    assert {k: float(v) for k, v in got.items()} == {"is_masked_frac_age0": 0.0, "is_masked_frac_age1": 0.0,
                                                     "is_masked_frac_age2plus": 0.0}
