"""TP / PP / DP and micro-batching leave PPO's numbers unchanged (real ranks on gloo).

Every comparison goes through tests/dist/parity.py: each quantity has a tolerance set between
the noise that the reduction order alone gives it and the smallest real error it must catch.
The reference is also run in another reduction order (2 threads; micro-batches of 1 and 2),
and a test asserts each tolerance is a safe multiple of the noise that measures on this
machine; a deliberately wrong TP shard must fail every kind of comparison by far more than
its tolerance."""
import json

import pytest
from conftest import run_py
from parity import NOISE_MARGIN, REORDERED, SWAP, TOLERANCES, assert_parity, errors


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


LAYOUTS = {   # name: (ranks, overrides)
    "tp2": (2, ["parallel.tp=2"]),
    "pp2": (2, ["parallel.pp=2"]),
    "dp2": (2, []),
    "tp2pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
    "tp2_recompute": (2, ["parallel.tp=2", "train.recompute=full"]),
    "dp2_offload": (2, ["train.offload_idle=true"]),
}
MICRO_BATCHES = (1, 2)   # the reruns of parity.REORDERED with smaller micro-batches
# the stale-data stabilizers on an off-policy batch (probe stale=1), each with the gradient-
# alignment projection at threshold 0 (it acts at every update that has a predecessor)
GAC = ["algo.grad_align=project", "algo.grad_align_threshold=0.0"]
STABILIZERS = {"m2po": ["algo.m2po_tau=0.04", *GAC], "bapo": ["algo.bapo=true", "algo.bapo_rho=0.6", *GAC]}
STABILIZER_LAYOUTS = {"tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"], "dp2": []}


# The checkpoint test's cases, last in the 2-rank launch (in this order: the cases of a launch
# run one after the other): 2 steps at TP=2 saved, then resumed at TP=1 x PP=2 for the third
# step, once as saved and once with a wrong shard in the loaded weights. Each case builds its
# models anew and loads only what the checkpoint holds, as a new process would.
def checkpoint_cases(ckpt) -> list[str]:
    return ["--case", "ckpt_save_tp2", "train.steps=2", "parallel.tp=2", f"save={ckpt}",
            "--case", "ckpt_resumed_pp2", "train.steps=3", "parallel.pp=2", f"resume={ckpt}",
            "--case", "ckpt_swapped_pp2", "train.steps=3", "parallel.pp=2", f"resume={ckpt}", SWAP]


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """3 PPO steps of every case, one launch per world size (the cases of a launch run one
    after the other in its ranks, each with its models built anew): the single-rank reference
    and its perturbed reruns on 1 rank, the layouts (and the wrong shard) on 2 and on 4 ranks,
    and the checkpoint saved at one layout and resumed at another on 2 (checkpoint_cases)."""
    tmp = tmp_path_factory.mktemp("layouts")
    cases = {1: ["--case", "ref", "train.steps=3"]}
    for name, settings in REORDERED.items():
        cases[1] += ["--case", name, "train.steps=3", *settings]
    for name, (nproc, overrides) in LAYOUTS.items():
        cases.setdefault(nproc, []).extend(["--case", name, "train.steps=3", *overrides])
    cases[2] += ["--case", "tp2_swapped", "train.steps=3", "parallel.tp=2", SWAP]
    cases[1] += ["--case", "stale", "train.steps=3", "stale=1"]
    for opt, settings in STABILIZERS.items():
        cases[1] += ["--case", opt, "train.steps=3", "stale=1", *settings]
        for name, overrides in STABILIZER_LAYOUTS.items():
            cases[2] += ["--case", f"{name}_{opt}", "train.steps=3", "stale=1", *settings, *overrides]
    cases[2] += checkpoint_cases(tmp / "ckpt")
    out = {}
    for nproc, args in cases.items():
        out.update(probe(tiny_model, tmp, f"world{nproc}", nproc, args))
    return out


@pytest.fixture(scope="module")
def reference(runs):
    return runs["ref"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_rank(runs, reference, name):
    """Over 3 PPO steps (2 optimizer updates each) actor and critic losses, gradient norms,
    the logprobs before any update and after each step at this layout equal TP=PP=DP=1 within
    the tolerances of parity.py."""
    got = runs[name]
    assert len(got) == 3
    assert_parity(got, reference, what=name)


def test_microbatch_split_leaves_update_unchanged(runs, reference):
    """Splitting each mini-batch into micro-batches of 1 or 2 instead of 4 rows gives the same
    losses and updates (the loss is normalised by the global batch, not per micro-batch)."""
    for mbs in MICRO_BATCHES:
        assert_parity(runs[f"mbs{mbs}"], reference, what=f"micro_batch_size={mbs}")


def test_tolerances_clear_the_noise_of_another_reduction_order(runs, reference):
    """The reference rerun with 2 threads and with micro-batches of 1 and 2 rows differs from
    itself by fp32 reduction order alone: each tolerance must be at least NOISE_MARGIN times
    that, or another processor's kernels (another order again) would fail the layout tests at
    random. A failure here means a tolerance is too tight for this machine's noise: see
    DEVELOPERS.md, "Numerical tolerances", and tools/parity_margins.py."""
    noise = {}
    for name in REORDERED:
        for key, err in errors(runs[name], reference).items():
            noise[key] = max(noise.get(key, 0.0), err)
    assert set(noise) == set(TOLERANCES)
    # the perturbations really change the order: some quantity moved (bitwise equal would
    # measure no noise and prove nothing)
    assert any(v > 0 for v in noise.values()), noise
    tight = {k: f"noise {v:.2g} of its tolerance, at most {1 / NOISE_MARGIN:g} allowed"
             for k, v in noise.items() if v * NOISE_MARGIN > 1}
    assert not tight, f"tolerances under {NOISE_MARGIN:g}x the noise measured here: {tight}"


def test_a_wrong_tp_shard_fails_the_comparison(runs, reference):
    """Two rows of one TP shard of one weight swapped (at TP=2, rank 1's part of the first
    MLP's input weight): the comparison fails, by far more than its tolerance, on the logprobs
    before any update, on the gradient norms and on the logprobs after the updates."""
    with pytest.raises(AssertionError, match="logp_start"):
        assert_parity(runs["tp2_swapped"], reference, what="wrong shard")
    errs = errors(runs["tp2_swapped"], reference)
    assert errs["logp_start"] > 1000 and errs["logp"] > 100 and errs["grad_norm"] > 10, errs


def test_reference_run_learns_something(reference):
    """Guard against a vacuous comparison: the probe's updates really move the policy."""
    first, last = reference[0]["logp_start"], reference[-1]["logp"]
    assert max(abs(a - b) for a, b in zip(first, last)) > 1e-3
    assert all(step["grad_norm"] > 0 and step["critic_grad_norm"] > 0 for step in reference)


# The stabilizers' own statistics: the mask and the bounds exactly; the gradient cosine (a
# ratio of dot products of gradients that agree to ~1e-6 relative, near 0 here) within 2e-5
# absolute (measured across the layouts: 2.2e-6; a projection that used one rank's gradient
# instead of the reduced one moves it by 1e-2 or more).
STABILIZER_STATS = (("m2po_masked_frac", 0), ("bapo_low", 0), ("bapo_high", 0),
                    ("grad_align_corrected_frac", 0), ("grad_cosine", 2e-5))


@pytest.mark.parametrize("opt", list(STABILIZERS))
@pytest.mark.parametrize("layout", list(STABILIZER_LAYOUTS))
def test_stabilizer_matches_single_rank(runs, opt, layout):
    """M2PO's mask and BAPO's bounds come from the whole mini-batch, the gradient cosine and
    its projection from dot products all-reduced over the ranks: TP=2, PP=2 and DP=2 give the
    single rank's update within the tolerances of parity.py (M2PO trains without a ratio clip:
    its post-update logprobs drifted by up to 1.2e-4 at TP=2, within the 1e-3 they get), and
    the statistics themselves match."""
    got, ref = runs[f"{layout}_{opt}"], runs[opt]
    assert_parity(got, ref, what=f"{opt} at {layout}")
    for step, (x, y) in enumerate(zip(got, ref)):
        for key, tol in STABILIZER_STATS:
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


def test_checkpoint_resumes_at_another_layout(runs, reference):
    """Actor, critic and distributed-optimizer state saved as megatron dist checkpoints at TP=2
    resume at TP=1 x PP=2: the loaded weights give the uninterrupted run's logprobs, and the
    third step gives its losses, gradient norms and logprobs (Adam moments and step count
    included: a wrong step count shows here). A wrong shard in the loaded weights fails it."""
    assert_parity(runs["ckpt_save_tp2"], reference[:2], what="before save")
    # the weights the resumed run starts from are those the uninterrupted run had after step 1
    expected = [{"logp": reference[1]["logp"]}]
    for name in ("ckpt_resumed_pp2", "ckpt_swapped_pp2"):
        assert len(runs[name]) == 1
        loaded = [{"logp": runs[name][0]["logp_start"]}]
        if name == "ckpt_resumed_pp2":
            assert_parity(loaded, expected, what="loaded weights")
            assert_parity(runs[name], reference[2:], what="after resume")
        else:
            assert errors(loaded, expected)["logp"] > 100
            with pytest.raises(AssertionError, match="grad_norm"):
                assert_parity(runs[name], reference[2:], what="wrong shard after resume")
