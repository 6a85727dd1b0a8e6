"""The trainer starts from a converted megatron checkpoint (model.megatron_path) exactly as from
the HF files: tiny model converted at TP=2, PPO steps at TP=2 (2 gloo ranks) from both give the
same losses, gradient norms and logprobs; a TP=2 checkpoint also loads at TP=1 (resharded)."""
import json

import pytest
from conftest import run_py
from parity import assert_parity

from megarl.config import ConfigError
from megarl.models.loading import check_megatron_dir


@pytest.fixture(scope="module")
def megatron_tp2(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("mg") / "tp2"
    proc = run_py(["tools/convert_hf_to_megatron.py", "--hf", str(tiny_model), "--out", str(out),
                   "--tp", "2", "--no-progress"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def probe(tiny_model, out, nproc, overrides):
    launch = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"] if nproc > 1 else []
    proc = run_py(launch + ["tests/dist/layout_probe.py", str(tiny_model), str(out), *overrides])
    assert proc.returncode == 0, proc.stderr[-6000:]
    used = [f"{role} weights loaded from megatron checkpoint" in proc.stderr
            for role in ("actor", "reference", "critic")]
    assert all(used) if any("megatron_path" in o for o in overrides) else not any(used)
    return json.loads(out.read_text())


def test_tp2_run_from_megatron_equals_run_from_hf(tiny_model, megatron_tp2, tmp_path):
    """Actor, reference and critic (value head freshly zeroed) built from the checkpoint: the
    first step's numbers (old logprobs -> ratios -> losses -> grads) and the logprobs after the
    update are bitwise those of the run built from the HF files."""
    base = ["parallel.tp=2", "train.steps=1", "algo.kl_coef=0.01"]   # a KL term: the reference is built too
    from_hf = probe(tiny_model, tmp_path / "hf.json", 2, base)
    from_mg = probe(tiny_model, tmp_path / "mg.json", 2, base + [f"model.megatron_path={megatron_tp2}"])
    assert from_hf == from_mg
    assert from_hf[0]["grad_norm"] > 0 and from_hf[0]["critic_grad_norm"] > 0


def test_tp2_checkpoint_loads_at_tp1(tiny_model, megatron_tp2, tmp_path):
    """Another layout: the TP=2 checkpoint (vocab padded to 256) resharded onto one rank. Its
    padding rows are masked, so the numbers match the HF run up to fp32 reduction order (the
    longer vocabulary's reductions): within the layout tests' tolerances (parity.py: the
    logprobs of the loaded weights tightly, those after the update's Adam steps less so)."""
    base = ["train.steps=1", "algo.kl_coef=0.01"]
    from_hf = probe(tiny_model, tmp_path / "hf.json", 1, base)
    from_mg = probe(tiny_model, tmp_path / "mg.json", 1, base + [f"model.megatron_path={megatron_tp2}"])
    assert_parity(from_mg, from_hf, what="TP=2 checkpoint at TP=1")


def test_not_a_megatron_checkpoint_is_a_clear_error(tiny_model, tmp_path):
    """An HF folder, an empty folder and a missing one are refused before anything is built,
    naming the setting and how to make a checkpoint."""
    with pytest.raises(ConfigError, match="looks like an HF folder"):
        check_megatron_dir(str(tiny_model), "model.megatron_path")
    with pytest.raises(ConfigError, match="no metadata.json.*convert_hf_to_megatron"):
        check_megatron_dir(str(tmp_path), "model.megatron_path")
    with pytest.raises(ConfigError, match="does not exist"):
        check_megatron_dir(str(tmp_path / "nope"), "model.megatron_path")


def test_megarl_train_starts_from_megatron_checkpoint(tiny_model, megatron_tp2, remote_engine, tmp_path):
    """`megarl train` at TP=2 (2 ranks, a real vLLM server as remote engine) accepts
    model.megatron_path: one step runs, and the engine's logprobs (of the weights the trainer
    pushed) match the trainer's."""
    run_dir = tmp_path / "run"
    cli = ["-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "-m", "megarl.cli",
           "train", "recipes/tiny_cpu.yaml", f"model.path={tiny_model}",
           f"data.prompts={tiny_model}/prompts.jsonl", f"run.dir={run_dir}", "parallel.tp=2",
           "train.steps=1", "rollout.mode=sync", f"model.megatron_path={megatron_tp2}", *remote_engine.overrides]
    proc = run_py(cli, env=remote_engine.env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0]
    assert rows[0]["logprob_mismatch_mean"] < 1e-3
