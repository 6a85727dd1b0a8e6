"""Expert parallelism leaves PPO's numbers unchanged: a tiny Qwen3-MoE (4 experts, top-2, every
layer MoE) trained by layout_probe.py on 1 rank and with its experts split over 2 ranks
(parallel.ep=2: dp=2, each rank 2 experts; the allgather dispatcher on 1 rank: megarl refuses it
with ep > 1, tests/unit/test_moe_mapping.py); the comparison is
tests/dist/parity.py's (losses, gradient norms, logprobs before and after each update), with
its tolerances. A wrong expert shard (rows of one expert's fc1 swapped on one rank) fails it."""
import json
import shutil

import pytest
import torch
from conftest import run_py
from parity import assert_parity, errors

from tools import tiny_archs

TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "tokenization_countdown.py")


@pytest.fixture(scope="module")
def moe_model(tiny_model, tmp_path_factory):
    """The tiny Qwen3-MoE, random (no warm-up: parity needs no skill), with the countdown
    tokenizer; weights scaled so routing and logits are far from ties."""
    folder = tmp_path_factory.mktemp("tiny_moe")
    model = tiny_archs.make_model(0, "qwen3_moe")
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
    model.save_pretrained(folder)
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


CASES = {   # name: (ranks, overrides)
    "ref": (1, []),
    "ep2": (2, ["parallel.ep=2"]),
    "allgather": (1, ["parallel.moe_dispatcher=allgather"]),
    "ep2_swapped": (2, ["parallel.ep=2", "swap_rows=mlp.experts.local_experts.1.linear_fc1.weight"]),
}


@pytest.fixture(scope="module")
def runs(moe_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_layouts")
    launches: dict[int, list[str]] = {}
    for name, (nproc, overrides) in CASES.items():
        launches.setdefault(nproc, []).extend(["--case", name, "train.steps=2",
                                               "moe.load_balancing=none", *overrides])
    out = {}
    for nproc, args in launches.items():
        out.update(probe(moe_model, tmp, f"world{nproc}", nproc, args))
    return out


@pytest.mark.parametrize("name", ["ep2", "allgather"])
def test_expert_parallel_matches_single_rank(runs, name):
    assert len(runs[name]) == 2
    assert_parity(runs[name], runs["ref"], what=name)


def test_a_wrong_expert_shard_fails_the_comparison(runs):
    errs = errors(runs["ep2_swapped"], runs["ref"])
    assert errs["grad_norm"] > 1 and errs["logp_start"] > 1, errs


@pytest.mark.parametrize("nproc,overrides", [(2, ["parallel.ep=2"]), (4, ["parallel.ep=2", "parallel.tp=2"])],
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
