"""A reward model scored on the trainer ranks reproduces transformers' sequence classifier."""
import json

import pytest
from conftest import run_py, tiny_reward_model


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    return tiny_reward_model(tmp_path_factory.mktemp("rm") / "qwen2-rm", vocab=100)


@pytest.mark.parametrize("nproc,overrides", [(1, []), (2, ["parallel.tp=2"])])
def test_reward_model_scores_match_transformers(reward_model_dir, tmp_path, nproc, overrides):
    """Scores of ragged sequences (last-token pooling) equal transformers' within 1e-4, at TP=1
    and TP=2; the scores differ between sequences (the head is really applied). The kernels'
    reduction order moves them by 1.1e-6 at most (also with MKL_CBWR=COMPATIBLE and
    ATEN_CPU_CAPABILITY=default); the four scores are 0.3 to 2 apart, so pooling another token
    or a wrong head shows far above 1e-4."""
    out = tmp_path / "rm.json"
    launch = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"] if nproc > 1 else []
    proc = run_py(launch + ["tests/dist/reward_probe.py", str(reward_model_dir), str(out), *overrides])
    assert proc.returncode == 0, proc.stderr[-6000:]
    r = json.loads(out.read_text())
    assert r["ours"] == pytest.approx(r["hf"], abs=1e-4)
    assert max(r["hf"]) - min(r["hf"]) > 1e-3


def test_causal_lm_is_refused_as_reward_model(tiny_model):
    """Pointing reward.model_path at a causal LM fails with what a reward model must be."""
    from transformers import AutoConfig

    from megarl.models.reward import _as_causal_lm
    with pytest.raises(ValueError, match="ForSequenceClassification"):
        _as_causal_lm(AutoConfig.from_pretrained(tiny_model))
