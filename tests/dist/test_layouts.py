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


def assert_close(a, b, rel=1e-5, what="", logp_abs=2e-5):
    """Within `rel` relative. The policy loss is a sum of +- terms that nearly cancel (about
    1e-3 here, from terms of about 1e-1), so it also gets an absolute floor of 2e-6: fp32
    reduction order alone moves it by a few 1e-7, a real error by 1e-3 or more. Logprobs near
    0 (confident tokens) get an absolute floor of 2e-5: after two Adam steps, fp32 reduction
    order moved one of 175 by 6.2e-6 on a 2-core CPU machine (the same at the commit before
    the engine pool), while a wrong shard or mapping moves them by 1e-2 or more."""
    for step, (x, y) in enumerate(zip(a, b)):
        for key in ("policy_loss", "value_loss", "grad_norm", "critic_grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=rel, abs=2e-6), f"{what} step {step} {key}"
        assert x["logp"] == pytest.approx(y["logp"], rel=rel, abs=logp_abs), f"{what} step {step} logprobs"


LAYOUTS = {   # name: (ranks, overrides)
    "tp2": (2, ["parallel.tp=2"]),
    "pp2": (2, ["parallel.pp=2"]),
    "dp2": (2, []),
    "tp2pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
    "tp2_recompute": (2, ["parallel.tp=2", "train.recompute=full"]),
    "dp2_offload": (2, ["train.offload_idle=true"]),
}
MICRO_BATCHES = (1, 2)
# the stale-data stabilizers on an off-policy batch (probe stale=1), each with the gradient-
# alignment projection at threshold 0 (it acts at every update that has a predecessor)
GAC = ["algo.grad_align=project", "algo.grad_align_threshold=0.0"]
STABILIZERS = {"m2po": ["algo.m2po_tau=0.04", *GAC], "bapo": ["algo.bapo=true", "algo.bapo_rho=0.6", *GAC]}
STABILIZER_LAYOUTS = {"tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"], "dp2": []}


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
    cases[1] += ["--case", "stale", "train.steps=3", "stale=1"]
    for opt, settings in STABILIZERS.items():
        cases[1] += ["--case", opt, "train.steps=3", "stale=1", *settings]
        for name, overrides in STABILIZER_LAYOUTS.items():
            cases[2] += ["--case", f"{name}_{opt}", "train.steps=3", "stale=1", *settings, *overrides]
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


@pytest.mark.parametrize("opt", list(STABILIZERS))
@pytest.mark.parametrize("layout", list(STABILIZER_LAYOUTS))
def test_stabilizer_matches_single_rank(runs, opt, layout):
    """M2PO's mask and BAPO's bounds come from the whole mini-batch, the gradient cosine and
    its projection from dot products all-reduced over the ranks: TP=2, PP=2 and DP=2 give the
    single rank's update within 1e-5, and the statistics themselves match."""
    got, ref = runs[f"{layout}_{opt}"], runs[opt]
    # The update (losses and gradient norms, and below the stabilizers' own statistics) within
    # 1e-5 relative: a mask, bound or coefficient computed differently on some rank moves
    # them. The post-update logprobs get an absolute floor of 2e-4: M2PO trains without a
    # ratio clip, and at TP=2 its logprobs drifted from one rank's by up to 1.2e-4 (measured
    # with and without the projection) while the gradient norms agreed within 2e-6 relative.
    # Adam's first steps move each element by about +-lr whatever its gradient's size, so an
    # element whose gradient is near 0 takes its sign from fp32 reduction order.
    assert_close(got, ref, what=f"{opt} at {layout}", logp_abs=2e-4)
    for step, (x, y) in enumerate(zip(got, ref)):
        # the mask and the bounds exactly; the cosine (a ratio of dot products of gradients
        # that agree to ~1e-6 relative, near 0 here) within 2e-5 absolute (measured 2.2e-6)
        for key, tol in (("m2po_masked_frac", 0), ("bapo_low", 0), ("bapo_high", 0),
                         ("grad_align_corrected_frac", 0), ("grad_cosine", 2e-5)):
            if key in y:
                assert x[key] == pytest.approx(y[key], abs=tol or 1e-12), f"{opt} at {layout}: step {step} {key}"


def test_stabilizers_act_on_the_stale_batch(runs):
    """Guard against a vacuous comparison: on the off-policy batch M2PO masks some tokens but
    not all, BAPO moves its bounds off their start, the projection fires, and each changes
    the update against plain clipping on the same batch."""
    plain, m2po, bapo = runs["stale"], runs["m2po"], runs["bapo"]
    assert all(0.05 < s["m2po_masked_frac"] < 0.95 for s in m2po), [s["m2po_masked_frac"] for s in m2po]
    assert any(s["bapo_high"] > 1.2 or s["bapo_low"] > 0.6 for s in bapo)
    for case in (m2po, bapo):
        # every step has 2 updates, so each one logs the cosine of its second with its first
        assert all(-1 <= s["grad_cosine"] <= 1 and 0 <= s["grad_align_corrected_frac"] <= 1 for s in case)
        assert any(s["grad_align_corrected_frac"] > 0 for s in case)
        assert case[0]["grad_norm"] != pytest.approx(plain[0]["grad_norm"], rel=1e-3)


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
