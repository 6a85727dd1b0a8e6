"""rollout.overlap: the forward-only passes run during the round give bitwise the step that the
same passes after the round give (losses, metrics, weights), on real megatron ranks (gloo):
one rank, and DP=2 / PP=2 / TP=2 on two (tests/dist/overlap_probe.py)."""
import json

import pytest
from conftest import run_py, tiny_reward_model

MODES = ("overlap", "after", "plain")
LAYOUTS = {"dp1": (1, []), "dp2": (2, []), "pp2": (2, ["parallel.pp=2"]), "tp2": (2, ["parallel.tp=2"])}


@pytest.fixture(scope="module")
def reward_model_dir(tiny_model, tmp_path_factory):
    """A tiny sequence classifier on the tiny model's vocabulary (random weights)."""
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    return tiny_reward_model(tmp_path_factory.mktemp("overlap_rm") / "rm", vocab)


@pytest.fixture(scope="module")
def runs(tiny_model, reward_model_dir, tmp_path_factory):
    """Every mode at every layout: one launch per world size (2 ranks: the DP=2, PP=2 and TP=2 cases)."""
    tmp = tmp_path_factory.mktemp("overlap")
    out = {}
    for world in (1, 2):
        args = []
        for name, (nproc, overrides) in LAYOUTS.items():
            # overlap=false (plain) on one rank only: what it shows does not depend on the layout
            for mode in MODES if nproc == world else ():
                if mode != "plain" or name == "dp1":
                    args += ["--case", f"{name}_{mode}", mode, *overrides]
        launch = ["tests/dist/overlap_probe.py"] if world == 1 else \
            ["-m", "torch.distributed.run", f"--nproc_per_node={world}", "--standalone", "tests/dist/overlap_probe.py"]
        path = tmp / f"world{world}.json"
        proc = run_py(launch + [str(tiny_model), str(reward_model_dir), str(path), *args], timeout=600)
        assert proc.returncode == 0, proc.stderr[-6000:]
        out.update(json.loads(path.read_text()))
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_overlap_equals_the_same_passes_after_the_round_bitwise(runs, layout):
    """Both steps: every metric (losses, gradient norms, KL, advantages, values, reward-model
    score) and the actor's and critic's weights are bit-identical; the overlap did run passes
    during the round (fewer actor rows in the update) and took 3 of 4 groups from them."""
    over, after = runs[f"{layout}_overlap"], runs[f"{layout}_after"]
    assert over["initial"] == after["initial"]
    dp = 2 if layout == "dp2" else 1
    for step, (o, a) in enumerate(zip(over["steps"], after["steps"])):
        om = {k: v for k, v in o["metrics"].items() if k != "overlap_rows"}
        am = {k: v for k, v in a["metrics"].items() if k != "overlap_rows"}
        assert om == am, (layout, step, {k: (om[k], am.get(k)) for k in om if om[k] != am.get(k)})
        assert o["weights"] == a["weights"], (layout, step)
        assert o["metrics"]["overlap_rows"] == 0.75 and a["metrics"]["overlap_rows"] == 0.0
        # the precomputed groups' old logprobs were not computed again: 3 groups of 4 rows
        assert a["actor_rows"] - o["actor_rows"] == 12 // dp, (layout, step)
    assert len(over["steps"]) == 2 and over["steps"][0]["weights"] != over["steps"][1]["weights"]


def test_group_layout_is_close_to_the_whole_batch_passes(runs):
    """overlap on (group by group, each padded to its own longest row) vs off (the whole batch
    at once): the same step up to fp32 reduction order (a row's values depend on the padded
    length), never a different computation.

    Noise, measured by rerunning both with MKL_CBWR=COMPATIBLE and ATEN_CPU_CAPABILITY=default:
    8.4e-6 relative at most (the gradient norm), except the second step's KL, a mean of
    logprobs after the first step's Adam updates (~3e-3, DEVELOPERS.md "Numerical tolerances"),
    which moved by 4.1e-6 absolute: it gets 1e-4 absolute (24x), still 30x under the whole KL
    that logprobs of the wrong weights would add."""
    over, plain = runs["dp1_overlap"], runs["dp1_plain"]
    tolerance = {"kl": {"abs": 1e-4}}   # default: 1e-4 relative, 1e-5 absolute
    for o, p in zip(over["steps"], plain["steps"]):
        for key in ("policy_loss", "value_loss", "kl", "advantage_mean", "rm_score_mean", "value_mean", "grad_norm"):
            if key in p["metrics"]:
                tol = tolerance.get(key, {"rel": 1e-4, "abs": 1e-5})
                assert o["metrics"][key] == pytest.approx(p["metrics"][key], **tol), key
