"""LoRA in `megarl plan` (megarl/plan/lora.py, docs/lora.md "Planning"): the adapters' sizes
against the adapters apply_lora really builds on a tiny megatron model made from an HF config
(GQA; an MoE one with attention adapters), at TP=1 and in TP=2's shapes."""
import pytest
import torch
import transformers
from test_moe_mapping import hf_config as moe_hf_config
from test_moe_mapping import megatron_world  # noqa: F401  (the one-rank gloo world)

from megarl.config.schema import ConfigError, LoraConfig
from megarl.models.arch import arch_from_hf
from megarl.plan import lora as plan_lora

ALL = ["qkv", "proj", "fc1", "fc2"]


def llama_config():
    """GQA (8 heads, 2 KV heads), head_dim 8 x 8 = hidden 64, SwiGLU of 96: every target's A
    and B differ in shape."""
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
                                   num_key_value_heads=2, vocab_size=100, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def built_adapters(hf, lora: LoraConfig) -> dict[str, int]:
    """{layer name: A + B elements} of the adapters apply_lora builds on the trainer's model."""
    from megarl.models.builders import build_model
    from megarl.models.lora import apply_lora, lora_layers
    from megarl.models.transformer_config import transformer_config
    model, _ = build_model(hf, transformer_config(hf, 1, 1, torch.float32, on_gpu=False), 128, "actor")
    held = apply_lora(model, lora)
    layers = {n: m for n, m in model.named_modules() if m in set(lora_layers(model))}
    sizes = {n: m.lora_a.numel() + m.lora_b.numel() for n, m in layers.items()}
    assert sum(sizes.values()) == held
    # the adapters are the only trainable parameters
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == held
    return sizes


@pytest.mark.usefixtures("megatron_world")
@pytest.mark.parametrize("targets", [ALL, ["qkv"], ["proj", "fc2"], ["fc1"]])
def test_adapter_count_is_what_apply_lora_builds(targets):
    hf = llama_config()
    arch = arch_from_hf(hf.to_dict())
    sizes = built_adapters(hf, LoraConfig(rank=4, targets=targets))
    assert sum(sizes.values()) == plan_lora.adapter_params(arch, 4, targets)
    assert len(sizes) == 3 * len(targets)
    for t in targets:   # each target's share, not only the sum
        (ar, ac), (br, bc) = plan_lora.target_shapes(arch, 4, t)
        name = {"qkv": "linear_qkv", "proj": "linear_proj", "fc1": "linear_fc1", "fc2": "linear_fc2"}[t]
        assert {v for k, v in sizes.items() if k.endswith(name)} == {ar * ac + br * bc}


@pytest.mark.usefixtures("megatron_world")
def test_moe_model_attention_adapters_and_refused_mlps():
    hf = moe_hf_config("qwen3_moe")   # head_dim 16 x heads != hidden: q is heads x head_dim
    arch = arch_from_hf({**hf.to_dict(), "architectures": hf.architectures})
    assert arch.moe and arch.heads * arch.head_dim != arch.hidden
    sizes = built_adapters(hf, LoraConfig(rank=2, targets=["qkv", "proj"]))
    assert sum(sizes.values()) == plan_lora.adapter_params(arch, 2, ["qkv", "proj"])
    with pytest.raises(ConfigError, match=r"model\.lora\.targets=.*expert MLPs.*qkv and proj only"):
        plan_lora.adapter_params(arch, 2, ALL)


@pytest.mark.usefixtures("megatron_world")
@pytest.mark.parametrize("kind,target", [("column", "qkv"), ("column", "fc1"), ("row", "proj"), ("row", "fc2")])
def test_tp2_shapes_are_the_layers(monkeypatch, kind, target):
    """On one of 2 TP ranks LoRALinear splits B of a column-parallel layer and A of a row-parallel
    one: the shapes it builds (TP size read from megarl.distributed.parallel) are target_shapes'."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megarl.models import lora as layers
    arch = arch_from_hf(llama_config().to_dict())
    (ar, ac), (br, bc) = plan_lora.target_shapes(arch, 4, target, tp=1)
    fan_in, fan_out = ac, br
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=8, use_cpu_initialization=True,
                            params_dtype=torch.float32, gradient_accumulation_fusion=False)
    init = torch.nn.init.normal_
    base = (ColumnParallelLinear(fan_in, fan_out, config=cfg, init_method=init, bias=False, gather_output=False)
            if kind == "column" else RowParallelLinear(fan_in, fan_out, config=cfg, init_method=init, bias=False,
                                                       input_is_parallel=True, skip_bias_add=False))
    monkeypatch.setattr(layers.parallel, "tp_size", lambda: 2)
    monkeypatch.setattr(layers.parallel, "tp_rank", lambda: 1)
    layer = layers.LoRALinear(base, 4, 8.0, 0.0, seed=0)
    want_a, want_b = plan_lora.target_shapes(arch, 4, target, tp=2)
    assert (tuple(layer.lora_a.shape), tuple(layer.lora_b.shape)) == (want_a, want_b)
    # the column layer's B and the row layer's A are the halves
    assert (want_b[0] * 2 == fan_out) if kind == "column" else (want_a[1] * 2 == fan_in)


def test_llama_70b_adapters_by_hand():
    """Llama-3.1-70B at rank 64 on all four targets: 80 x 64 x (8192 + 10240 + 8192 + 8192 + 8192 +
    57344 + 28672 + 8192) = 702,545,920 elements, 1.0% of the model's 70.55B."""
    from megarl.config import load_config
    from megarl.models.arch import resolve_arch
    arch, _ = resolve_arch(load_config("recipes/models/llama3.1_70b.yaml"))
    n = plan_lora.adapter_params(arch, 64, ALL)
    assert n == 80 * 64 * (8192 + 10240 + 8192 + 8192 + 8192 + 57344 + 28672 + 8192) == 702_545_920
    assert plan_lora.adapter_params(arch, 0, ALL) == 0
    assert plan_lora.largest_adapter_tensor(arch, 64, ALL) == 2 * 28672 * 64
    # a PP stage's layers: the share of them
    assert plan_lora.adapter_params(arch, 64, ALL, layers=16) * 5 == n
