"""`megarl simulate` without --lengths assumes response lengths from the recipe's budget
(rollout.sampling.max_new_tokens), not ~20 tokens whatever the recipe, and prints the
distribution it used."""
from conftest import ROOT

from megarl.cli import main
from megarl.config import load_config
from megarl.sim import recipe as sim

SMALL = ["train.groups_per_step=2", "rollout.sampling.n=2", "rollout.partial.concurrency=8", "train.mini_batches=1"]


def test_default_lengths_follow_the_recipes_budget():
    cfg = load_config(ROOT / "recipes/qwen2.5_7b.yaml", SMALL)
    assert cfg.rollout.sampling.max_new_tokens == 3072
    costs = sim.roofline_costs(cfg, "h100", "", cfg.rollout.engines.tp, sim.trainer_gpus(cfg))
    out = sim.run(cfg, "", costs, 2)
    lengths = out["lengths"]
    assert 600 < lengths["median"] < 950 and lengths["max"] <= 3072   # a quarter of the budget, capped
    assert "max_new_tokens" in lengths["from"]


def test_simulate_prints_the_lengths_it_used(capsys):
    assert main(["simulate", str(ROOT / "recipes/qwen2.5_7b.yaml"), "--steps", "2", *SMALL]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("response lengths: lognormal:mu=6.64,sigma=1 (the recipe's default") and "median" in first
    assert main(["simulate", str(ROOT / "recipes/qwen2.5_7b.yaml"), "--steps", "2", "--lengths", "fixed:len=100",
                 *SMALL]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("response lengths: fixed:len=100 (--lengths)")
