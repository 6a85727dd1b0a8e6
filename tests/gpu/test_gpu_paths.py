"""GPU-only paths: Transformer Engine layer specs, bf16, NCCL. Skipped without a GPU.

Run on a GPU machine with `pytest tests/gpu`; each test launches its own process so megatron
and NCCL state never leak between tests.
"""
import json

import pytest
import torch
from conftest import run_py

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROBE = r'''
import json, sys, torch
from megarl.config import load_config
from megarl.distributed import parallel
from megarl.distributed.env import init_distributed
def main():
    cfg = load_config("recipes/tiny_cpu.yaml", [f"model.path={sys.argv[1]}", f"model.dtype={sys.argv[3]}",
                                                "algo.name=grpo"])
    init_distributed()
    parallel.initialize(1, 1, 0)
    from megarl.models.builders import use_te
    from megarl.models.setup import build_all
    from megarl.ppo import actor as actor_ops
    from megarl.ppo.batch import build_batch
    from megarl.data.sample import Sample
    from transformers import AutoModelForCausalLM
    models = build_all(cfg)
    ids = [1, 20, 4, 19, 18, 17, 16]
    batch = build_batch([Sample(ids[:3], ids[3:], [0.0] * 4, [0] * 4, True, 0)], 0)
    ours = actor_ops.logprobs(models.actor.model, batch, 1, models.actor.info.vocab_size)[0]
    hf = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).cuda()
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids]).cuda()).logits[0, 2:-1].float(), -1)
    ref = lp.gather(-1, torch.tensor(ids[3:]).cuda()[:, None])[:, 0].cpu()
    json.dump({"te": use_te(), "max_diff": float((ours.cpu() - ref).abs().max())}, open(sys.argv[2], "w"))
if __name__ == "__main__":
    main()
'''


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-3), ("bfloat16", 5e-2)])
def test_te_spec_actor_matches_transformers(tiny_model, tmp_path, dtype, tol):
    """On GPU the trainer builds Transformer Engine layer specs, and the actor's logprobs of
    a countdown answer match transformers' within tol."""
    script, out = tmp_path / "probe.py", tmp_path / "out.json"
    script.write_text(PROBE)
    proc = run_py([str(script), str(tiny_model), str(out), dtype])
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    try:
        import transformer_engine  # noqa: F401
        assert result["te"] is True
    except ImportError:
        assert result["te"] is False
    assert result["max_diff"] < tol


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_sequence_parallel_actor_matches_transformers(tiny_model, tmp_path):
    """TP=2 with sequence parallelism (TE LayerNorm on split activations) keeps the actor's
    logprobs equal to transformers' within 1e-3 (fp32)."""
    out = tmp_path / "sp.json"
    proc = run_py(["-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                   "tests/dist/model_probe.py", str(out), str(tiny_model), "parallel.tp=2",
                   "parallel.sequence_parallel=true"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert all(d < 1e-3 for d in json.loads(out.read_text()).values())


PUSH_PROBE = r'''
import json, sys, torch
from megarl.config import load_config
from megarl.distributed import parallel
from megarl.distributed.env import init_distributed
def main():
    model, out, staging = sys.argv[1:4]
    cfg = load_config("recipes/tiny_cpu.yaml", [f"model.path={model}", "model.dtype=float32",
                      "rollout.engines.count=1", "rollout.engines.enforce_eager=false",
                      "rollout.sampling.temperature=0.7"])
    init_distributed()
    parallel.initialize(1, 1, 0)
    from megarl.models.setup import build_all
    from megarl.rollout.weights import sync as weight_sync
    from megarl.rollout.weights import files
    from megarl.rollout.engines.pool import open_pool
    models = build_all(cfg)
    assert next(models.actor.model.parameters()).is_cuda
    with torch.no_grad():   # an engine that missed the push cannot match by accident
        for p in models.actor.model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    pool = open_pool(cfg.rollout, cfg.model.path, 0, staging)
    try:
        timings = files.push(models.actor.model, models.actor.info, pool, 1, staging, 64, "gpu")
        gaps = weight_sync.engine_mismatch(models.actor, pool, [[1, 20, 4], [1, 19, 4]], 8, 1, 0.7)
    finally:
        pool.close()
    json.dump({"gaps": gaps, "version": pool.version, **timings}, open(out, "w"))
if __name__ == "__main__":
    main()
'''


def _has_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _has_vllm(), reason="needs vLLM with CUDA")
def test_weight_push_from_cuda_trainer_reaches_cuda_engine(tiny_model, tmp_path):
    """The trainer's parameters live on the GPU: the push gathers them there, copies each
    bucket to the host once, and the CUDA vLLM engine (CUDA graphs on) then samples with the
    trainer's logprobs at T=0.7."""
    script, out = tmp_path / "push.py", tmp_path / "out.json"
    script.write_text(PUSH_PROBE)
    proc = run_py([str(script), str(tiny_model), str(out), str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["version"] == 1
    assert all(gap < 1e-3 for gap in result["gaps"].values()), result
