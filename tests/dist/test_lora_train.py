"""PPO with LoRA on the actor (model.lora.rank=4, a KL term: the reference is the actor's base)
at TP=2, PP=2 and DP=2 equals one rank (and a LoRA critic at TP=2), the base stays frozen everywhere, the weight push
sends the same merged tensors at every layout, and an adapters-only checkpoint saved at TP=2
resumes at PP=2 (real ranks on gloo: lora_train_probe.py over layout_probe.py's steps).

Tolerances are parity.py's (the layout tests' own, set from the noise of the full fine-tune;
the adapted model's updates are smaller, its noise no larger). The merged push's sums: 1e-9
relative (TP=2 / PP=2 merge and gather the same fp32 numbers as one rank; measured bitwise
equal or ~1e-15)."""
import json
from pathlib import Path

import pytest
from conftest import run_py
from parity import assert_parity

COMMON = ["train.steps=3", "algo.kl_coef=0.01"]
CASES = {   # name: (ranks, overrides)
    "tp2": (2, ["parallel.tp=2"]),
    "pp2": (2, ["parallel.pp=2"]),
    "dp2": (2, []),
    "tp2_recompute": (2, ["parallel.tp=2", "train.recompute=full"]),
}


def launch(tiny_model, tmp, nproc, args):
    out = tmp / f"world{nproc}.json"
    cmd = ["tests/dist/lora_train_probe.py"] if nproc == 1 else \
        ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", "tests/dist/lora_train_probe.py"]
    proc = run_py(cmd + [str(tiny_model), str(out), *args])
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_train")
    ckpt = tmp / "ckpt"
    one = ["--case", "ref", *COMMON, "--case", "ref_critic", *COMMON, "model.lora.critic=true",
           "--case", "push1", "push"]
    two = []
    for name, (_, overrides) in CASES.items():
        two += ["--case", name, *COMMON, *overrides]
    two += ["--case", "tp2_critic", *COMMON, "parallel.tp=2", "model.lora.critic=true"]
    two += ["--case", "ckpt_save_tp2", "train.steps=2", "algo.kl_coef=0.01", "parallel.tp=2", f"save={ckpt}",
            "--case", "ckpt_resumed_pp2", *COMMON, "parallel.pp=2", f"resume={ckpt}",
            "--case", "push_tp2", "push", "parallel.tp=2", "--case", "push_pp2", "push", "parallel.pp=2"]
    out = launch(tiny_model, tmp, 1, one)
    out.update(launch(tiny_model, tmp, 2, two))
    out["ckpt_dir"] = str(ckpt)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_lora_layout_matches_single_rank(runs, name):
    """Losses, gradient norms (over the adapters only: megatron's clip/norm over the optimizer's
    parameters) and logprobs before and after each update equal one rank's within parity.py's
    tolerances; the reference logprobs (the KL term) come from the same actor model."""
    assert_parity(runs[name]["history"], runs["ref"]["history"], what=f"LoRA at {name}")
    assert runs[name]["facts"]["reference_is_actor"] == 2   # both ranks: no second model


def test_lora_critic_at_tp2_matches_single_rank(runs):
    """model.lora.critic=true: the critic's adapters and its value head (trained in full) at TP=2
    give one rank's value losses and critic gradient norms, and differ from the full critic's."""
    assert_parity(runs["tp2_critic"]["history"], runs["ref_critic"]["history"], what="LoRA critic at tp2")
    full, lora = runs["ref"]["history"], runs["ref_critic"]["history"]
    assert lora[-1]["critic_grad_norm"] != pytest.approx(full[-1]["critic_grad_norm"], rel=1e-3)


@pytest.mark.parametrize("name", ["ref", *CASES])
def test_base_frozen_and_only_adapters_held(runs, name):
    """After 3 steps at every layout: no base tensor changed and every adapter shard did; the
    DDP grad buffers hold the adapters' elements only, and the distributed optimizer's main
    parameters (split over DP) the adapters' elements once."""
    f, dp = runs[name]["facts"], 2 if name == "dp2" else 1
    assert f["frozen_changed"] == 0 and f["adapters_unchanged"] == 0, f
    assert f["grad_buffer_elements"] == f["adapter_elements"], f
    assert f["optimizer_elements"] * dp == f["adapter_elements"], f


def test_reference_run_learns(runs):
    """Guard against a vacuous comparison: the adapters move the policy and have a gradient."""
    ref = runs["ref"]["history"]
    assert max(abs(a - b) for a, b in zip(ref[0]["logp_start"], ref[-1]["logp"])) > 1e-3
    assert all(s["grad_norm"] > 0 for s in ref)


@pytest.mark.parametrize("name", ["push_tp2", "push_pp2"])
def test_merged_push_is_the_same_at_every_layout(runs, name):
    """The merged weights the push sends (hf_tensors) and the sharded push's pieces, assembled,
    hold the same numbers at TP=2 and PP=2 as on one rank: each shard's W + s B A is the full
    merge's block (a misplaced adapter shard changes the sums of squares)."""
    ref, got = runs["push1"], runs[name]
    assert set(got) == set(ref) and any(k.startswith("pieces_") for k in ref)
    for k, (s, q) in ref.items():
        assert got[k][0] == pytest.approx(s, rel=1e-9, abs=1e-9) and got[k][1] == pytest.approx(q, rel=1e-9), k


def test_adapters_only_checkpoint_resumes_at_another_layout(runs, tiny_model):
    """Saved at TP=2 after 2 steps, resumed at PP=2 for the third: the weights it starts from
    give the uninterrupted run's logprobs after step 1 and the third step its figures (adapters'
    Adam moments and step count included). The actor folder holds the adapters only (far
    smaller than the model's weights) and names its base."""
    ref = runs["ref"]["history"]
    assert_parity(runs["ckpt_save_tp2"]["history"], ref[:2], what="before save")
    resumed = runs["ckpt_resumed_pp2"]["history"]
    assert len(resumed) == 1
    assert_parity([{"logp": resumed[0]["logp_start"]}], [{"logp": ref[1]["logp"]}], what="loaded weights")
    assert_parity(resumed, ref[2:], what="after resume")
    actor = next(Path(runs["ckpt_dir"]).glob("step_*")) / "actor"
    model_bytes = sum(f.stat().st_size for f in Path(tiny_model).glob("*.safetensors"))
    ckpt_bytes = sum(f.stat().st_size for f in actor.rglob("*") if f.is_file())
    assert ckpt_bytes < model_bytes / 2, (ckpt_bytes, model_bytes)
    assert json.loads((actor / "base.json").read_text())["base"] == str(Path(tiny_model).resolve())
