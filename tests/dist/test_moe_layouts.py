"""Expert parallelism leaves PPO's numbers unchanged: a tiny Qwen3-MoE (4 experts, top-2, every
layer MoE) trained by layout_probe.py on 1 rank and with its experts split over 2 ranks
(parallel.ep=2: dp=2, each rank 2 experts), over TP=2 x EP=2 (each expert split over TP too;
sequence parallelism on, as megatron's MoE layers need at TP > 1) and PP=2 x EP=2 on 4 ranks,
and the allgather dispatcher on 1 rank (megarl refuses it with ep > 1: models/moe_layout.py);
the comparison is tests/dist/parity.py's (losses, gradient norms, logprobs before and after each
update), with its tolerances. A wrong expert shard (rows of one expert's fc1 swapped on one
rank) fails it. A dist checkpoint saved at EP=2 resumes at EP=1, and one saved at EP=1 at
TP=2 x EP=2, and one saved at EP=2 at EP=4: the next step equals the uninterrupted run's."""
import json
import shutil

import pytest
from conftest import run_py
from parity import assert_parity, errors

from tools import tiny_archs

TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "tokenization_countdown.py")


@pytest.fixture(scope="module")
def moe_model(tiny_model, tmp_path_factory):
    """The tiny Qwen3-MoE, random (no warm-up: parity needs no skill), with the countdown
    tokenizer; weights scaled so routing and logits are far from ties."""
    folder = tmp_path_factory.mktemp("tiny_moe")
    tiny_archs.save_untied(folder)
    for f in TOKENIZER:
        shutil.copy(tiny_model / f, folder / f)
    return folder


def probe(model, tmp_path, name, nproc, args):
    out = tmp_path / f"{name}.json"
    launch = ["tests/dist/layout_probe.py"] if nproc == 1 else [
        "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", "tests/dist/layout_probe.py"]
    proc = run_py(launch + [str(model), str(out), *args])
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


EP2, SP = ["parallel.ep=2"], ["parallel.tp=2", "parallel.sequence_parallel=true"]
SWAP_EXPERT = "swap_rows=mlp.experts.local_experts.1.linear_fc1.weight"
# name: (ranks, overrides); {ckpt}: the module's checkpoint folder. The launches run by rank
# count in this order (2, 1, 4), one launch each, so that a checkpoint one launch saves is
# there for the next one to resume from at another EP: saved after step 0 (train.steps=1),
# resumed for step 1 (train.steps=2), whose numbers the reference has.
CASES = {
    "ep2": (2, EP2),
    "ep2_swapped": (2, [*EP2, SWAP_EXPERT]),
    "save_ep2": (2, [*EP2, "train.steps=1", "save={ckpt}/ep2"]),
    "ref": (1, []),
    "allgather": (1, ["parallel.moe_dispatcher=allgather"]),
    "save_ep1": (1, ["train.steps=1", "save={ckpt}/ep1"]),
    "ep2_to_ep1": (1, ["resume={ckpt}/ep2"]),
    "ep2_to_ep1_swapped": (1, ["resume={ckpt}/ep2", SWAP_EXPERT]),
    # megatron trains MoE layers at TP > 1 only with sequence parallelism (docs/moe.md)
    "tp2ep2": (4, [*SP, *EP2]),
    "pp2ep2": (4, ["parallel.pp=2", *EP2]),
    "ep1_to_tp2ep2": (4, [*SP, *EP2, "resume={ckpt}/ep1"]),
    "ep2_to_ep4": (4, ["parallel.ep=4", "resume={ckpt}/ep2"]),   # one expert per rank
}
LAYOUTS = ("ep2", "allgather", "tp2ep2", "pp2ep2")
RESUMED = ("ep2_to_ep1", "ep1_to_tp2ep2", "ep2_to_ep4")


@pytest.fixture(scope="module")
def runs(moe_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_layouts")
    launches: dict[int, list[str]] = {}
    for name, (nproc, overrides) in CASES.items():
        launches.setdefault(nproc, []).extend(["--case", name, "train.steps=2", "moe.load_balancing=none",
                                               *(o.format(ckpt=tmp / "ckpt") for o in overrides)])
    out = {}
    for nproc, args in launches.items():
        out.update(probe(moe_model, tmp, f"world{nproc}", nproc, args))
    return out


@pytest.mark.parametrize("name", LAYOUTS)
def test_expert_parallel_matches_single_rank(runs, name):
    """EP=2, TP=2 x EP=2 (sequence parallel) and PP=2 x EP=2 on 2 and 4 ranks, and the allgather
    dispatcher on 1: losses, gradient norms and logprobs of 2 PPO steps equal the single
    rank's within parity.py's tolerances."""
    assert len(runs[name]) == 2
    assert_parity(runs[name], runs["ref"], what=name)


def test_a_wrong_expert_shard_fails_the_comparison(runs):
    errs = errors(runs["ep2_swapped"], runs["ref"])
    assert errs["grad_norm"] > 1 and errs["logp_start"] > 1, errs


@pytest.mark.parametrize("name", RESUMED)
def test_checkpoint_resumes_at_another_expert_layout(runs, name):
    """Actor, critic and distributed-optimizer state saved after step 0 at EP=2 resume at EP=1
    (experts of 2 ranks into 1) and at EP=4 (one expert per rank), and saved at EP=1 resume at
    TP=2 x EP=2 (each expert split over TP too): the loaded weights give the uninterrupted
    run's logprobs after step 0, and step 1 its losses, gradient norms and logprobs (Adam's
    moments and step count included)."""
    ref, got = runs["ref"], runs[name]
    assert len(got) == 1
    assert_parity([{"logp": got[0]["logp_start"]}], [{"logp": ref[0]["logp"]}], what=f"{name}: loaded weights")
    assert_parity(got, ref[1:], what=f"{name}: after resume")


def test_a_wrong_expert_after_resume_fails_the_comparison(runs):
    """The same resume with two rows of one expert swapped in the loaded weights: the
    comparison catches it, so a resharding that misplaced an expert's rows would fail."""
    got, ref = runs["ep2_to_ep1_swapped"], runs["ref"]
    assert errors([{"logp": got[0]["logp_start"]}], [{"logp": ref[0]["logp"]}])["logp"] > 10
    with pytest.raises(AssertionError, match="grad_norm"):
        assert_parity(got, ref[1:], what="wrong expert after resume")


@pytest.mark.parametrize("nproc,overrides", [(2, EP2), (4, [*EP2, *SP])],
                         ids=["ep2", "tp2ep2"])
def test_weight_push_gathers_every_expert_once(moe_model, tmp_path, nproc, overrides):
    """The collective route's sender side at EP=2 (and TP=2 x EP=2 on 4 ranks): every HF tensor
    of the checkpoint, each expert's included, is sent exactly once and bitwise equal to the
    checkpoint (no step taken), from buckets no larger than the bucket size allows (the largest
    tensor, 128 KiB, alone); and an HF export of the same actor (which gathers as the push does)
    holds every tensor bitwise."""
    out = tmp_path / "push.json"
    proc = run_py(["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
                   "tests/dist/moe_push_probe.py", str(moe_model), str(out), str(64 << 10), *overrides])
    assert proc.returncode == 0, proc.stderr[-6000:]
    got = json.loads(out.read_text())
    assert sorted(got["tensors"]) == got["expected"]
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in got["tensors"]
    bad = {n: e for n, e in got["tensors"].items() if e[0] != 1 or not e[1]}
    assert not bad, bad
    assert got["largest_bucket"] <= 128 << 10
    assert got["exported"]
