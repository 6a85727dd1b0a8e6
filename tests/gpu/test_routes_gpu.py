"""Routing replay on a CUDA build of vLLM: the in-process engine asks vLLM for its own capture
(`enable_return_routed_experts`, CompletionOutput.routed_experts) instead of megarl's CPU hook,
and returns the same rows: one per token of prompt + response but the last, uint8, equal to
transformers' router top-k of the same tokens (fp32 both; the tiny MoE's weights are scaled so
routing is far from ties). Skipped without a GPU or without vLLM."""
import numpy as np
import pytest
import torch

from megarl.rollout.engines.engine import GenRequest
from tools import tiny_archs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_moe_routes_gpu")
    tiny_archs.save_untied(folder)
    return folder


def test_vllm_own_capture_gives_the_routers_choices(moe_dir):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from megarl.config import load_config
    from megarl.rollout.engines.pool import open_pool
    cfg = load_config("recipes/tiny_cpu.yaml", [f"model.path={moe_dir}", "rollout.engines.count=1",
                                                "rollout.engines.mode=inprocess"])
    hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    reqs = [GenRequest(f"r{i}", [1] + torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist(), m,
                       seed=i, ignore_eos=True) for i, (n, m) in enumerate([(6, 10), (20, 4)])]
    pool = open_pool(cfg.rollout, str(moe_dir), 0, str(moe_dir), routes=True)
    try:
        assert not pool.pool.engines[0]._capturing, "a CUDA build must use vLLM's own capture"
        results = pool.call(pool.pool.generate_all(reqs), "two requests at once")
    finally:
        pool.close()
    k = hf.config.num_experts_per_tok
    for req, res in zip(reqs, results):
        tokens = list(req.prompt_ids) + list(res.token_ids)
        with torch.no_grad():
            out = hf(torch.tensor([tokens]), output_router_logits=True)
        want = torch.stack([torch.topk(r.float(), k, -1).indices for r in out.router_logits], 1)[:-1].numpy()
        assert res.routes is not None and res.routes.dtype == np.uint8
        assert res.routes.shape == want.shape
        same = (np.sort(res.routes, -1) == np.sort(want, -1)).all(-1).mean()
        assert same == 1.0, f"{req.key}: {same:.3f} of the token-layer choices equal transformers'"
