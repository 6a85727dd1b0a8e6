"""The simulator's trainer computes the positions the batching rule computes (padding, the
busiest DP rank), so `megarl simulate` shows the padded and the recipe's trainer side by side."""
import numpy as np
import pytest

from megarl.config import load_config
from megarl.ppo.microbatch import Batching
from megarl.sim import recipe as sim
from megarl.sim.costs import H100, RooflineTrainer, StepShape, published_models

R7 = "recipes/qwen2.5_7b.yaml"


def long_tailed(count=512, seed=0, cap=3072):
    rng = np.random.default_rng(seed)
    return [int(v) for v in np.clip(np.rint(np.exp(5.5 + 1.2 * rng.standard_normal(count))), 1, cap)]


def test_positions_count_padding_of_the_rule_and_the_busiest_rank():
    resp = long_tailed()
    seq = [300 + n for n in resp]
    real = sum(seq)
    padded = StepShape(Batching(micro_batch_size=1, remove_padding=False), dp=4, mini_batches=4)
    budget = StepShape(Batching(max_tokens=8192), dp=4, mini_batches=4)
    update, forward = padded.positions(seq, resp)
    assert update == forward == len(seq) * max(seq)             # every row at the step's longest
    b_update, b_forward = budget.positions(seq, resp)
    assert real <= b_update < 1.3 * real and real <= b_forward < 1.3 * real
    one = StepShape(Batching(max_tokens=8192), dp=1, mini_batches=4).positions(seq, resp)[0]
    assert one <= b_update                                    # 4 ranks cost 4 x the busiest


def test_roofline_trainer_charges_the_positions_of_its_shape():
    m = published_models()["qwen2.5-7b"]
    resp = long_tailed(64, seed=3)
    tokens = sum(resp)
    plain = RooflineTrainer(m, H100, 8)
    padded = RooflineTrainer(m, H100, 8, shape=StepShape(Batching(remove_padding=False), 2, 2))
    budget = RooflineTrainer(m, H100, 8, shape=StepShape(Batching(max_tokens=8192), 2, 2))
    assert padded.train_s(tokens, 0, 64) == plain.train_s(tokens, 0, 64)     # no lengths: real tokens
    assert budget.train_s(tokens, 0, 64, lengths=resp) < padded.train_s(tokens, 0, 64, lengths=resp) / 2
    assert budget.train_s(tokens, 0, 64, lengths=resp) == pytest.approx(plain.train_s(tokens, 0, 64), rel=0.3)
    assert budget.forward_s(tokens, 64, lengths=resp) < budget.train_s(tokens, 0, 64, lengths=resp)


def test_simulate_shows_the_padded_and_the_recipes_trainer_side_by_side():
    cfg = load_config(R7, ["train.groups_per_step=8", "rollout.partial.concurrency=64",
                           "rollout.partial.max_step_multiple=1"])   # the same steps in both runs
    costs = sim.roofline_costs(cfg, "h100", "", 1, 8)
    out = sim.run(cfg, "pareto:alpha=1.3,xmin=20", costs, steps=1)
    for mode in ("sync", "partial"):
        padded, ours = out["padded"][mode], out["modes"][mode]
        assert padded["computed_per_real"] > ours["computed_per_real"] + 0.2
        assert 1.0 <= ours["computed_per_real"] < 1.3
        assert padded["train_unit_s"] > ours["train_unit_s"]   # per groups_per_step groups (elastic steps)
    table = sim.format_table(out)
    assert "padded      sync" in table and "recipe's    sync" in table
