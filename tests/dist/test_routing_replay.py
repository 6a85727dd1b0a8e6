"""algo.routing_replay on the tiny random Qwen3-MoE (4 experts, top-2, both layers MoE), one GRPO
step per case through route_replay_probe.py: at 1 rank, and at 2 ranks with EP=2, PP=2 and TP=2
with sequence parallelism.

- r3 replays the engine's experts: with seeded random experts per token (an engine that routes
  otherwise than the trainer), the trainer's old logprobs of the sampled tokens equal a
  transformers forward forced to those experts (the behaviour logprobs), the update and the
  reference replay them too (ratio 1 at the first update, KL 0), in backward recompute as well;
  routing agreement measures how often the trainer's routers would have chosen the same.
- off: the same samples' logprobs move far from the forced forward (replay changes them).
- r2: the old-logprob pass routes as without replay (logprobs equal transformers' plain forward)
  and its recorded experts, gathered over DP, are the model's own.
"""
import json

import pytest
from conftest import run_py
from test_moe_layouts import moe_model  # noqa: F401  (the module fixture: the tiny random MoE)

# Old logprobs vs a transformers forward on the same experts: the two sum in different orders.
# Noise: 1.9e-6 (max over the 16 samples' tokens, at 1 rank, EP=2 and PP=2 alike), 2.4e-6 at
# TP=2 with sequence parallelism and under ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE.
# Catch: the same samples without replay are 2.4 nats away (routes=forced under off); a
# misplaced route moves its token by O(0.1).
LOGP_TOL = 1e-5

PROBE = "tests/dist/route_replay_probe.py"
SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
CASES = {   # name: (ranks, probe arguments)
    "r3": (1, ["routes=forced", "algo.routing_replay=r3"]),
    "off": (1, ["routes=forced"]),
    "r3_own": (1, ["routes=own", "algo.routing_replay=r3"]),
    "r2": (1, ["routes=none", "algo.routing_replay=r2"]),
    "r3_no_routes": (1, ["routes=none", "algo.routing_replay=r3"]),
    "ep2": (2, ["routes=forced", "algo.routing_replay=r3", "parallel.ep=2"]),
    "ep2_recompute": (2, ["routes=forced", "algo.routing_replay=r3", "parallel.ep=2", "train.recompute=full"]),
    "ep2_r2": (2, ["routes=none", "algo.routing_replay=r2", "parallel.ep=2"]),
    "pp2": (2, ["routes=forced", "algo.routing_replay=r3", "parallel.pp=2"]),
    # 1F1B runs the next micro-batch's forward before this one's backward: the recompute must
    # take the routes of the micro-batch it recomputes, not the last ones set
    "pp2_recompute": (2, ["routes=forced", "algo.routing_replay=r3", "parallel.pp=2", "train.recompute=full"]),
    "pp2_r2": (2, ["routes=none", "algo.routing_replay=r2", "parallel.pp=2"]),
    # sequence parallelism: each TP rank's routers see half of each micro-batch's positions
    "tp2sp": (2, ["routes=forced", "algo.routing_replay=r3", *SP]),
    "tp2sp_r2": (2, ["routes=none", "algo.routing_replay=r2", *SP]),
    # a refused sample and episodes whose routes stop after their last model token: filler
    "r3_refused_tail": (1, ["routes=forced", "samples=refused_tail", "algo.routing_replay=r3"]),
    "r3_own_tail": (1, ["routes=own", "samples=refused_tail", "algo.routing_replay=r3"]),
    "ep2_refused_tail": (2, ["routes=forced", "samples=refused_tail", "algo.routing_replay=r3", "parallel.ep=2"]),
}


@pytest.fixture(scope="module")
def runs(moe_model, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("routing_replay")
    launches: dict[int, list[str]] = {}
    for name, (nproc, args) in CASES.items():
        launches.setdefault(nproc, []).extend(["--case", name, *args])
    out = {}
    for nproc, args in launches.items():
        path = tmp / f"world{nproc}.json"
        launch = [PROBE] if nproc == 1 else ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
                                            PROBE]
        proc = run_py(launch + [str(moe_model), str(path), *args])
        assert proc.returncode == 0, proc.stderr[-6000:]
        out.update(json.loads(path.read_text()))
    return out


@pytest.mark.parametrize("name", ["r3", "ep2", "pp2", "ep2_recompute", "pp2_recompute", "tp2sp"])
def test_r3_logprobs_are_those_of_the_engines_experts(runs, name):
    got = runs[name]
    assert got["logprob_mismatch_max"] < LOGP_TOL, got
    # the carry's l_old (partial rollout's stitching, rollout.lag): the routes travel from rank 0
    assert got["carry_mismatch_max"] < LOGP_TOL, got
    # the update's forward and the reference replay the same experts as the old-logprob pass
    assert abs(got["ratio_mean"] - 1) < 1e-6 and got["approx_kl"] < 1e-9 and got["kl"] < 1e-9, got
    # random experts agree with the model's own choice for about 1 token-layer in 6 (1 / C(4, 2))
    assert got["routing_agreement"] < 0.5, got
    assert got["routing_agreement"] == runs["r3"]["routing_agreement"]   # the same tokens and routers
    assert got["train_route_bytes"] > 0


def test_without_replay_the_same_samples_are_far_from_the_engines_experts(runs):
    assert runs["off"]["logprob_mismatch_max"] > 1000 * LOGP_TOL, runs["off"]
    assert "routing_agreement" not in runs["off"]


@pytest.mark.parametrize("name,plain", [("ep2_recompute", "ep2"), ("pp2_recompute", "pp2")])
def test_recompute_in_backward_replays_each_micro_batchs_experts(runs, name, plain):
    """train.recompute=full runs each layer's forward again in backward: the gradient is the
    one of the replayed experts only if the recompute replays them too, each micro-batch its own.
    Catch: a recompute routing on its own moved the gradient norm by 1.5% (EP=2); one replaying
    the last micro-batch set instead of its own by 2.6% (PP=2); the two runs agree exactly."""
    assert abs(runs[name]["grad_norm"] - runs[plain]["grad_norm"]) < 1e-6 * runs[plain]["grad_norm"]


def test_r3_of_the_models_own_experts_agrees_fully(runs):
    got = runs["r3_own"]
    assert got["routing_agreement"] == 1.0 and got["logprob_mismatch_max"] < LOGP_TOL, got


@pytest.mark.parametrize("name", ["r2", "ep2_r2", "pp2_r2", "tp2sp_r2"])
def test_r2_records_the_models_own_experts_and_leaves_old_logprobs_alone(runs, name):
    got = runs[name]
    assert got["recorded_same"] == 1.0 and got["train_route_bytes"] > 0, got
    assert got["logprob_mismatch_max"] < LOGP_TOL and abs(got["ratio_mean"] - 1) < 1e-6, got


def test_r3_without_routes_is_refused_naming_the_setting(runs):
    error = runs["r3_no_routes"].get("error", "")
    assert "algo.routing_replay=r3" in error and "Sample.routes" in error, runs["r3_no_routes"]
    assert "algo.routing_replay=r3" in runs["r3_no_routes"]["carry_error"], runs["r3_no_routes"]


@pytest.mark.parametrize("name", ["r3_refused_tail", "ep2_refused_tail"])
def test_samples_without_routes_past_their_last_trained_token_train(runs, name):
    """A refused sample (no response, no routes) and episodes carried between turns (no routes
    for the observation after their last model token) neither stop the step nor the carry's
    l_old: the positions past the last trained token take filler experts, which reach no
    trained logprob (causal attention), so the trained tokens' logprobs stay those of the
    engine's experts. Before, the batch had no routes and r3 refused it."""
    got = runs[name]
    assert "error" not in got and "carry_error" not in got, got
    assert got["logprob_mismatch_max"] < LOGP_TOL and got["carry_mismatch_max"] < LOGP_TOL, got
    assert abs(got["ratio_mean"] - 1) < 1e-6 and got["kl"] < 1e-9, got
    assert got["routing_agreement"] < 0.5, got


def test_routing_agreement_leaves_filler_positions_out(runs):
    """The model's own experts as the engine's, episodes' routes cut after their last model
    token: every scored position agrees. Scoring the filler experts 0, 1 past the cut as well
    would count the router's disagreements with them."""
    got = runs["r3_own_tail"]
    assert got.get("routing_agreement") == 1.0 and got["logprob_mismatch_max"] < LOGP_TOL, got
