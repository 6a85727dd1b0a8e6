"""Length-aware micro-batches (ppo/microbatch.py) compute what the padded layout computes, at
every layout and for every loss aggregation (real ranks on gloo; tests/dist/token_budget_probe.py).

The reference is the layout before length-aware batching on one rank: every row padded to the
batch's longest, 4 rows per micro-batch, DP shares in row order. Against it, on a long-tailed
batch (one response of 200 tokens, most of a few): micro-batches of 4 rows each padded to its
own longest ("rows", the default rule) and micro-batches by a token budget of 256 ("budget"),
at 1 rank, TP=2, PP=2 (shapes vary between micro-batches through the pipeline) and DP=2 (rows
dealt by tokens: the ranks hold different row counts).
"""
import json

import pytest
from conftest import run_py

from megarl.config.registry import LOSS_AGGS

# One launch per world size (each launch spends most of its time importing torch and
# megatron in every rank): the reference and both rules on 1 rank; the token budget at TP=2,
# PP=2 and DP=2, and the row rule at DP=2 (its DP split keeps row counts equal).
LAUNCHES = {1: ["--case", "one"],
            2: ["--case", "tp2", "rules=budget", "parallel.tp=2",
                "--case", "pp2", "rules=budget", "parallel.pp=2",
                "--case", "dp2", "rules=budget,rows"]}
COMPARED = [("one", "rows"), ("one", "budget"), ("tp2", "budget"), ("pp2", "budget"), ("dp2", "budget"),
            ("dp2", "rows")]
# Noise, measured by rerunning the one-rank cases in another reduction order (MKL_CBWR=COMPATIBLE,
# ATEN_CPU_CAPABILITY=default; fp32, 2-core CPU): losses, gradient norms, KL and value means move
# by up to 1.1e-6 relative, logprobs (-0.1 to -15) by up to 6.2e-6 absolute; the rules and layouts
# differ from the padded reference by as much (a logprob depends on its micro-batch's padded length
# through fp32 kernel shapes). The tolerances are 9x and 8x that (DEVELOPERS.md, "Numerical
# tolerances"); a row trained twice or lost, a wrong normaliser, or a shape mix-up moves them by
# 1e-2 or more.
REL, LOGP_ABS = 1e-5, 5e-5
KEYS = ("policy_loss", "value_loss", "grad_norm", "critic_grad_norm", "kl", "value_mean")


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("token_budget")
    out = {}
    for nproc, args in LAUNCHES.items():
        path = tmp / f"world{nproc}.json"
        launch = (["tests/dist/token_budget_probe.py"] if nproc == 1 else
                  ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
                   "tests/dist/token_budget_probe.py"])
        proc = run_py(launch + [str(tiny_model), str(path), *args])
        assert proc.returncode == 0, proc.stderr[-6000:]
        out.update(json.loads(path.read_text()))
    return out


@pytest.mark.parametrize("case,rule", COMPARED, ids=[f"{c}-{r}" for c, r in COMPARED])
def test_length_aware_micro_batches_give_the_padded_losses_and_gradients(runs, case, rule):
    """Per loss aggregation mode, one PPO step with the critic (2 mini-batches): policy and
    value losses, both gradient norms, the KL and value means equal the padded single rank's
    within 1e-5 relative; so do the old logprobs and the carry's stitched l_old (absolute)."""
    ref, got = runs["one"]["padded"], runs[case][rule]
    assert set(got["steps"]) == set(LOSS_AGGS.names()) == set(ref["steps"])
    for agg, want in ref["steps"].items():
        for key in KEYS:
            assert got["steps"][agg][key] == pytest.approx(want[key], rel=REL), f"{case} {rule} {agg} {key}"
        # a mean of normalised advantages, ~0: absolute (noise 1.9e-8)
        assert got["steps"][agg]["advantage_mean"] == pytest.approx(want["advantage_mean"], abs=1e-6)
    assert got["logp"] == pytest.approx(ref["logp"], abs=LOGP_ABS), f"{case} {rule} old logprobs"
    assert got["carry"] == pytest.approx(ref["carry"], abs=LOGP_ABS), f"{case} {rule} stitched l_old"


def test_a_rank_without_rows_computes_a_filler_that_changes_nothing(runs):
    """One-row mini-batches (8 updates) and a one-sample carry at DP=2: the rank without a
    row runs a filler micro-batch; losses, gradient norms and the l_old equal one rank's."""
    one, dp2 = runs["one"]["fill"], runs["dp2"]["fill"]
    for key in KEYS:
        assert dp2["step"][key] == pytest.approx(one["step"][key], rel=REL), key
    assert dp2["carry"] == pytest.approx(one["carry"], abs=LOGP_ABS)
    assert dp2["step"]["train_padding_frac"] > one["step"]["train_padding_frac"]   # the fillers' positions


def test_the_rules_compute_different_micro_batches_on_a_long_tailed_batch(runs):
    """Guard against a vacuous comparison: the padded layout computes mostly padding, the
    budget about the real tokens in fewer micro-batches than 4 rows each would take; the
    aggregation modes give different losses, and the values and KL are not 0."""
    one = runs["one"]
    padded, rows, budget = (one[r]["steps"]["token-mean"] for r in ("padded", "rows", "budget"))
    assert padded["train_padding_frac"] > 0.8
    assert budget["train_padding_frac"] < 0.25 < rows["train_padding_frac"] < padded["train_padding_frac"]
    assert budget["train_tokens_computed"] < rows["train_tokens_computed"] < padded["train_tokens_computed"]
    assert budget["train_micro_batches"] < rows["train_micro_batches"]
    losses = [s["policy_loss"] for s in one["padded"]["steps"].values()]
    assert len({round(x, 6) for x in losses}) == len(losses)
    assert abs(padded["value_mean"]) > 0.1 and abs(padded["kl"]) > 0.01


def test_data_parallel_ranks_run_as_many_micro_batches_on_their_share_of_tokens(runs):
    """At DP=2 (global ranks 0 and 1 are DP ranks 0 and 1) the actor's forward calls of a step
    (the old-logprob pass and the two updates) are as many on both ranks, each a micro-batch
    padded to its own longest row; under the token budget the ranks hold different row counts
    (dealt by tokens, not rows), no micro-batch over 256 tokens, and the reported imbalance is
    that of the tokens the ranks computed."""
    for rule in ("budget", "rows"):
        calls = runs["dp2"][rule]["calls"]
        assert len(calls) == 2 and len(calls[0]) == len(calls[1]) > 3, calls
    budget = runs["dp2"]["budget"]["calls"]
    assert all(rows * length <= 256 for rank in budget for rows, length in rank)
    assert sum(r for r, _ in budget[0]) != sum(r for r, _ in budget[1])
    assert len({length for rank in budget for _, length in rank}) > 3
    assert runs["dp2"]["budget"]["steps"]["token-mean"]["train_dp_token_imbalance"] >= 1.0
    assert runs["one"]["budget"]["steps"]["token-mean"]["train_dp_token_imbalance"] == 1.0
