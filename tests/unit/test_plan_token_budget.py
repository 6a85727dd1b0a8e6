"""`megarl plan` under a token budget (train.max_tokens_per_micro_batch): activations sized for
the largest micro-batch the batching rule (ppo/microbatch.py) can make."""
import pytest

from megarl.cli import main
from megarl.config import load_config
from megarl.plan import make_plan

R70 = "recipes/llama3.1_70b.yaml"


def trainer(*over):
    return make_plan(load_config(R70, list(over)))["trainer"]


def test_a_budget_of_one_longest_row_costs_what_micro_batch_1_costs():
    """4096 tokens hold one row of max_model_len 4096: the same activations and peak as one row
    per micro-batch; twice the budget holds twice the tokens: more activations."""
    budget = trainer()
    rows = trainer("train.max_tokens_per_micro_batch=0", "train.micro_batch_size=1")
    assert make_plan(load_config(R70))["max_tokens_per_micro_batch"] == 4096
    assert budget["peak_bytes"] == rows["peak_bytes"]
    assert budget["roles"]["activations"] == rows["roles"]["activations"]
    double = trainer("train.max_tokens_per_micro_batch=8192")
    two_rows = trainer("train.max_tokens_per_micro_batch=0", "train.micro_batch_size=2")
    assert double["roles"]["activations"] == pytest.approx(two_rows["roles"]["activations"])
    assert double["roles"]["activations"] > budget["roles"]["activations"]


def test_a_budget_that_does_not_fit_is_named_with_a_smaller_one(capsys):
    assert main(["plan", R70, "train.max_tokens_per_micro_batch=65536", "train.recompute=none"]) == 2
    err = capsys.readouterr().err
    assert "train.max_tokens_per_micro_batch=32768 -> " in err
    assert "train.micro_batch_size=1" not in err   # a row count would contradict the budget
    assert main(["plan", R70]) == 0
    assert "micro-batches of up to 4096 tokens" in capsys.readouterr().out
