"""LoRA layers (megarl/models/lora.py) at TP=1 against a reference written out here, their
freezing, `adapters_disabled`, `apply_lora` on a tiny GPTModel, and model.lora's checks. The
TP=2 split is tests/dist/test_lora_parity.py's."""
import pytest
import torch
from test_moe_mapping import megatron_world  # noqa: F401  (the one-rank gloo world)

from megarl.config import ConfigError, load_config
from megarl.config.schema import LoraConfig

IN, OUT, R, ALPHA = 24, 40, 4, 8.0
# fp32: the layer and the reference multiply the same numbers in another grouping
# ((x A^T) B^T vs x (B A)^T); measured max |diff| 4.8e-7 on outputs of size ~1; a B off by
# 1% moves the output by ~1e-2
ATOL = 1e-5


def linear(kind, bias=True):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig
    cfg = TransformerConfig(num_layers=1, hidden_size=IN, num_attention_heads=4, use_cpu_initialization=True,
                            params_dtype=torch.float32, gradient_accumulation_fusion=False)
    init = torch.nn.init.normal_
    if kind == "column":
        return ColumnParallelLinear(IN, OUT, config=cfg, init_method=init, bias=bias, gather_output=False)
    return RowParallelLinear(IN, OUT, config=cfg, init_method=init, bias=bias, input_is_parallel=True,
                             skip_bias_add=False)


def wrapped(kind, b_nonzero=True, **kw):
    from megarl.models.lora import LoRALinear
    base = linear(kind, **kw)
    layer = LoRALinear(base, R, ALPHA, 0.0, seed=3)
    if b_nonzero:
        with torch.no_grad():
            layer.lora_b.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    return layer


def x_in(seed=0):
    return torch.randn(5, 2, IN, generator=torch.Generator().manual_seed(seed), requires_grad=True)


def reference(layer, x):
    """x W^T + b + (alpha / r) x A^T B^T with the layer's own tensors, in plain torch."""
    w, b = layer.weight.detach(), layer.bias.detach()
    return x @ w.t() + b + (ALPHA / R) * (x @ layer.lora_a.detach().t()) @ layer.lora_b.detach().t()


@pytest.mark.usefixtures("megatron_world")
@pytest.mark.parametrize("kind", ["column", "row"])
def test_layer_equals_the_reference(kind):
    layer = wrapped(kind)
    x = x_in()
    out, bias = layer(x)
    assert bias is None
    torch.testing.assert_close(out, reference(layer, x), rtol=0, atol=ATOL)
    assert (out - x.detach() @ layer.weight.detach().t() - layer.bias.detach()).abs().max() > 100 * ATOL


@pytest.mark.usefixtures("megatron_world")
@pytest.mark.parametrize("kind", ["column", "row"])
def test_zero_b_at_init_is_the_base_exactly(kind):
    layer = wrapped(kind, b_nonzero=False)
    assert layer.lora_b.abs().max() == 0 and layer.lora_a.abs().max() > 0
    x = x_in()
    assert torch.equal(layer(x)[0], layer.base(x)[0])


@pytest.mark.usefixtures("megatron_world")
@pytest.mark.parametrize("kind", ["column", "row"])
def test_base_frozen_adapters_trained(kind):
    layer = wrapped(kind)
    x = x_in()
    g = torch.randn(5, 2, OUT, generator=torch.Generator().manual_seed(9))
    (layer(x)[0] * g).sum().backward()
    assert not layer.weight.requires_grad and layer.weight.grad is None and layer.bias.grad is None
    assert layer.lora_a.grad is not None and layer.lora_b.grad is not None
    # the adapters' gradients against autograd through the reference expression
    a = layer.lora_a.detach().clone().requires_grad_()
    b = layer.lora_b.detach().clone().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    ref = xr @ layer.weight.detach().t() + (ALPHA / R) * (xr @ a.t()) @ b.t()
    (ref * g).sum().backward()
    for got, want in ((layer.lora_a.grad, a.grad), (layer.lora_b.grad, b.grad), (x.grad, xr.grad)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.usefixtures("megatron_world")
@pytest.mark.parametrize("kind", ["column", "row"])
def test_tensor_parallel_attributes(kind):
    """The split adapter carries the base weight's TP attributes; the replicated one is not TP-split."""
    layer = wrapped(kind)
    split, repl = (layer.lora_b, layer.lora_a) if kind == "column" else (layer.lora_a, layer.lora_b)
    assert split.tensor_model_parallel and split.partition_dim == layer.weight.partition_dim
    assert split.partition_stride == 1
    assert not repl.tensor_model_parallel and repl.partition_dim == -1


@pytest.mark.usefixtures("megatron_world")
def test_init_is_seeded_and_a_pure_function_of_seed_and_name():
    from megarl.models.lora import adapter_seed, kaiming_uniform
    a1 = kaiming_uniform(4, 64, adapter_seed(0, "layers.0.x"))
    a2 = kaiming_uniform(4, 64, adapter_seed(0, "layers.0.x"))
    assert torch.equal(a1, a2) and a1.abs().max() <= 1 / 8
    assert not torch.equal(a1, kaiming_uniform(4, 64, adapter_seed(0, "layers.1.x")))
    assert not torch.equal(a1, kaiming_uniform(4, 64, adapter_seed(1, "layers.0.x")))


def tiny_gpt(moe=False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    kw = dict(num_moe_experts=2, moe_router_topk=2, moe_ffn_hidden_size=16, moe_token_dispatcher_type="alltoall",
              moe_grouped_gemm=False) if moe else {}
    cfg = TransformerConfig(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                            use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0,
                            attention_dropout=0.0, gradient_accumulation_fusion=False, add_bias_linear=False,
                            normalization="RMSNorm", gated_linear_unit=True, **kw)
    if moe:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16,
                    position_embedding_type="rope")


def logits(model):
    from megarl.models.masks import causal_mask
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    return model(ids, torch.arange(8).expand(2, 8), causal_mask(8, ids.device))


@pytest.mark.usefixtures("megatron_world")
def test_apply_lora_on_a_gpt_model():
    """Names kept (the base's weight keys unchanged, adapters beside them), everything but the
    adapters frozen, the model equal to its base at init, different once B moves, and equal
    to it again under adapters_disabled."""
    from megarl.models.lora import LoRALinear, adapters_disabled, apply_lora
    torch.manual_seed(0)
    model = tiny_gpt().eval()
    keys = set(model.state_dict())
    with torch.no_grad():
        before = logits(model)
    n = apply_lora(model, LoraConfig(rank=R, alpha=ALPHA, targets=["qkv", "proj", "fc1", "fc2"]))
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert len(layers) == 8
    new = set(model.state_dict()) - keys
    assert keys <= set(model.state_dict()) and all(k.endswith(("lora_a", "lora_b")) for k in new) and len(new) == 16
    trainable = {k for k, p in model.named_parameters() if p.requires_grad}
    assert trainable == new and n == sum(p.numel() for k, p in model.named_parameters() if k in new)
    with torch.no_grad():
        assert torch.equal(logits(model), before)
        for m in layers:
            m.lora_b.normal_(0, 0.1)
        moved = logits(model)
        assert (moved - before).abs().max() > 1e-3
        with adapters_disabled(model):
            assert torch.equal(logits(model), before)
        assert torch.equal(logits(model), moved)   # back on after the block
    # two layers draw different A's from the one seed
    assert not torch.equal(layers[0].lora_a, layers[4].lora_a)


@pytest.mark.usefixtures("megatron_world")
def test_apply_lora_targets_and_refusals():
    from megarl.models.lora import LoRALinear, apply_lora
    model = tiny_gpt()
    apply_lora(model, LoraConfig(rank=2, targets=["qkv"]))
    assert {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, LoRALinear)} == {"linear_qkv"}
    with pytest.raises(ValueError, match=r"^model\.lora\.targets=\['qkv', 'fc1'\]: expert MLPs are not supported yet"):
        apply_lora(tiny_gpt(moe=True), LoraConfig(rank=2, targets=["qkv", "fc1"]))
    assert apply_lora(tiny_gpt(moe=True), LoraConfig(rank=2, targets=["qkv", "proj"])) > 0


@pytest.mark.parametrize("overrides,named", [
    (["model.lora.rank=-1"], r"model\.lora\.rank=-1: must be >= 0"),
    (["model.lora.dropout=1.5"], r"model\.lora\.dropout=1\.5: must lie in \[0, 1\)"),
    (["model.lora.dropout=-0.1"], r"model\.lora\.dropout=-0\.1: must lie in \[0, 1\)"),
    (["model.lora.targets=[qkv,mlp]"], r"model\.lora\.targets=\['qkv', 'mlp'\]: unknown \['mlp'\]"),
    (["model.lora.rank=4", "model.lora.alpha=0"], r"model\.lora\.alpha=0\.0: must be > 0"),
    (["model.lora.rank=4", "model.lora.targets=[]"], r"model\.lora\.targets=\[\]: name at least one"),
    (["model.lora.rank=4", "weight_sync.transport=files"], r"weight_sync\.lora=adapters with "
     r"weight_sync\.transport=files: only the collective transport .*weight_sync\.lora=merged"),
    (["model.lora.rank=4", "weight_sync.backend=nccl"], r"weight_sync\.lora=adapters on the nccl wire "
     r"\(weight_sync\.backend=nccl\).*weight_sync\.lora=merged"),
])
def test_bad_settings_are_one_line_naming_the_setting(overrides, named):
    with pytest.raises(ConfigError, match=rf"^{named}") as err:
        load_config("recipes/tiny_cpu.yaml", overrides)
    assert "\n" not in str(err.value)


def test_expert_mlps_are_refused_naming_the_fix():
    with pytest.raises(ConfigError, match=r"^model\.lora\.targets=\['qkv', 'fc2'\]: expert MLPs are not supported "
                                          r"yet .*target qkv and proj only") as err:
        load_config("recipes/tiny_moe_cpu.yaml", ["model.lora.rank=4", "model.lora.targets=[qkv,fc2]",
                                                  *MOE_ARCH])
    assert "\n" not in str(err.value)


# the facts of a small MoE (model.arch), so the schema knows the model has experts
MOE_ARCH = ["model.arch.hidden_size=32", "model.arch.num_layers=2", "model.arch.num_heads=4",
            "model.arch.num_kv_heads=2", "model.arch.ffn_hidden_size=48", "model.arch.vocab_size=64",
            "model.arch.max_position_embeddings=64", "model.arch.num_experts=4", "model.arch.moe_top_k=2",
            "model.arch.moe_ffn_hidden_size=16"]


def test_defaults_are_off():
    cfg = load_config("recipes/tiny_cpu.yaml")
    assert cfg.model.lora == LoraConfig() and cfg.model.lora.rank == 0 and not cfg.model.lora.critic
    assert load_config("recipes/tiny_cpu.yaml", ["model.lora.rank=4"]).model.lora.rank == 4   # trained: no refusal
    assert cfg.model.lora.targets == ["qkv", "proj", "fc1", "fc2"] and cfg.model.lora.alpha == 16.0
