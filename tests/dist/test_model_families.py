"""The trainer's megatron models reproduce transformers' Llama 3.1, Qwen2, Mistral and Qwen3."""
import json

import pytest
import torch
from conftest import run_py
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from megarl.models.builders import rope_parameters

COMMON = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6)


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """Random tiny checkpoints: Llama 3.1 (llama3 RoPE scaling, untied), Qwen2 (QKV bias,
    tied embeddings), Mistral (untied), Qwen3 (QK norms, head_dim 32 apart from hidden / heads
    = 16). Vocab 100 exercises megatron's vocab padding."""
    root = tmp_path_factory.mktemp("families")
    torch.manual_seed(0)
    specs = {
        "llama31": (LlamaConfig, LlamaForCausalLM, dict(
            rope_theta=500000.0, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
        "mistral": (MistralConfig, MistralForCausalLM, dict(tie_word_embeddings=False, sliding_window=None)),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=False, head_dim=32)),
    }
    folders = []
    for name, (cfg_cls, model_cls, extra) in specs.items():
        model = model_cls(cfg_cls(**COMMON, **extra))
        with torch.no_grad():   # larger weights than the default init: differences show in logits
            for name, p in model.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0, 0.1)
                elif name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.normal_(1, 0.2)   # not all ones: a QK norm left out or swapped shows
        model.save_pretrained(root / name)
        folders.append(str(root / name))
    return folders


@pytest.mark.parametrize("nproc,overrides", [(1, []), (2, ["parallel.tp=2"]), (2, ["parallel.pp=2"])])
def test_actor_logprobs_match_transformers(families, tmp_path, nproc, overrides):
    """At TP=1, TP=2 (vocab-parallel logprobs over a padded vocab) and PP=2, the actor's
    per-token logprobs equal transformers' within 1e-4 for every family. The two models'
    kernels sum in different orders: 1.4e-6 apart at most at each layout (also with
    MKL_CBWR=COMPATIBLE and ATEN_CPU_CAPABILITY=default), 70x under the tolerance; a wrong
    mapping, RoPE or shard moves logprobs by 1e-2 or more."""
    out = tmp_path / "out.json"
    launch = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"] if nproc > 1 else []
    proc = run_py(launch + ["tests/dist/model_probe.py", str(out), ",".join(families), *overrides])
    assert proc.returncode == 0, proc.stderr[-6000:]
    diffs = json.loads(out.read_text())
    assert set(diffs) == set(families)
    for folder, diff in diffs.items():
        assert diff < 1e-4, f"{folder}: max |logprob diff| {diff}"


def test_unsupported_rope_scaling_is_refused():
    """llama3 RoPE values megatron-core cannot express are refused with the values named."""
    cfg = LlamaConfig(**COMMON, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    with pytest.raises(ValueError, match="low_freq_factor"):
        rope_parameters(cfg)
