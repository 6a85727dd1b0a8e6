"""TP / PP / DP and micro-batching leave PPO's numbers unchanged (real ranks on gloo)."""
import json

import pytest

from conftest import run_py


def probe(tiny_model, tmp_path, name, nproc, args):
    """One launch of layout_probe.py on `nproc` ranks; `args` may hold several --case groups."""
    out = tmp_path / f"{name}.json"
    if nproc == 1:
        launch = ["tests/dist/layout_probe.py"]
    else:
        launch = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
                  "tests/dist/layout_probe.py"]
    proc = run_py(launch + [str(tiny_model), str(out), *args])
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


def assert_close(a, b, rel=1e-5, what=""):
    """Within `rel` relative. The policy loss is a sum of +- terms that nearly cancel (about
    1e-3 here, from terms of about 1e-1), so it also gets an absolute floor of 2e-6: fp32
    reduction order alone moves it by a few 1e-7, a real error by 1e-3 or more. Logprobs near
    0 (confident tokens) get an absolute floor of 2e-5: after two Adam steps, fp32 reduction
    order moved one of 175 by 6.2e-6 on a 2-core CPU machine (the same at the commit before
    the engine pool), while a wrong shard or mapping moves them by 1e-2 or more."""
    for step, (x, y) in enumerate(zip(a, b)):
        for key in ("policy_loss", "value_loss", "grad_norm", "critic_grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=rel, abs=2e-6), f"{what} step {step} {key}"
        assert x["logp"] == pytest.approx(y["logp"], rel=rel, abs=2e-5), f"{what} step {step} logprobs"


LAYOUTS = {   # name: (ranks, overrides)
    "tp2": (2, ["parallel.tp=2"]),
    "pp2": (2, ["parallel.pp=2"]),
    "dp2": (2, []),
    "tp2pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
    "tp2_recompute": (2, ["parallel.tp=2", "train.recompute=full"]),
    "dp2_offload": (2, ["train.offload_idle=true"]),
}
MICRO_BATCHES = (1, 2)


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """3 PPO steps of every case, one launch per world size (the cases of a launch run one
    after the other in its ranks, each with its models built anew): the single-rank reference
    and its micro-batch splits on 1 rank, the layouts on 2 and on 4 ranks."""
    tmp = tmp_path_factory.mktemp("layouts")
    cases = {1: ["--case", "ref", "train.steps=3"]}
    for mbs in MICRO_BATCHES:
        cases[1] += ["--case", f"mbs{mbs}", "train.steps=3", f"train.micro_batch_size={mbs}"]
    for name, (nproc, overrides) in LAYOUTS.items():
        cases.setdefault(nproc, []).extend(["--case", name, "train.steps=3", *overrides])
    out = {}
    for nproc, args in cases.items():
        out.update(probe(tiny_model, tmp, f"world{nproc}", nproc, args))
    return out


@pytest.fixture(scope="module")
def reference(runs):
    return runs["ref"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_rank(runs, reference, name):
    """Over 3 PPO steps (2 optimizer updates each) actor and critic losses, gradient norms and
    post-step logprobs at this layout equal TP=PP=DP=1 within 1e-5 relative (fp32)."""
    got = runs[name]
    assert len(got) == 3
    assert_close(got, reference, what=name)


def test_microbatch_split_leaves_update_unchanged(runs, reference):
    """Splitting each mini-batch into micro-batches of 1 or 2 instead of 4 rows gives the same
    losses and updates (the loss is normalised by the global batch, not per micro-batch)."""
    for mbs in MICRO_BATCHES:
        assert_close(runs[f"mbs{mbs}"], reference, what=f"micro_batch_size={mbs}")


def test_reference_run_learns_something(reference):
    """Guard against a vacuous comparison: the probe's updates really move the policy."""
    first, last = reference[0]["logp"], reference[-1]["logp"]
    assert max(abs(a - b) for a, b in zip(first, last)) > 1e-3
    assert all(step["grad_norm"] > 0 and step["critic_grad_norm"] > 0 for step in reference)


def test_checkpoint_resumes_at_another_layout(tiny_model, tmp_path, reference):
    """Actor, critic and distributed-optimizer state saved as megatron dist checkpoints at TP=2
    resume at TP=1 x PP=2 and the third step gives the uninterrupted run's losses, gradient
    norms and logprobs (Adam moments and step count included: a wrong step count shows here)."""
    ckpt = tmp_path / "ckpt"
    first = probe(tiny_model, tmp_path, "save_tp2", 2, ["train.steps=2", "parallel.tp=2", f"save={ckpt}"])
    assert_close(first, reference[:2], what="before save")
    resumed = probe(tiny_model, tmp_path, "resume_pp2", 2, ["train.steps=3", "parallel.pp=2", f"resume={ckpt}"])
    assert len(resumed) == 1
    assert_close(resumed, reference[2:], what="after resume")
