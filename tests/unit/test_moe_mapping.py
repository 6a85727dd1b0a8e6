"""Mixture-of-Experts mapping tables (Qwen3-MoE, Qwen2-MoE): the HF names are those
transformers writes, the round trip through megatron shards is exact at every TP x PP x EP,
megarl's own megatron model has the table's names and reproduces transformers' logits, and
what the tables cannot map is refused naming it."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from megarl.formats.mapping import mapping_for
from megarl.models.arch import arch_from_hf

transformers = pytest.importorskip("transformers")

SIZES = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1])
LAYOUTS = [(1, 1, 1), (2, 2, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2), (2, 2, 4)]


def hf_config(arch: str, **kw):
    if arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(head_dim=16, norm_topk_prob=True, **{**SIZES, **kw})
        cfg.architectures = ["Qwen3MoeForCausalLM"]
    else:
        cfg = transformers.Qwen2MoeConfig(shared_expert_intermediate_size=24, **{**SIZES, **kw})
        cfg.architectures = ["Qwen2MoeForCausalLM"]
    cfg.tie_word_embeddings = False
    return cfg


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each family saved by transformers (its on-disk layout), with random weights: norms
    around 1, every other tensor scaled so logits are O(1)."""
    out = {}
    for arch in ("qwen3_moe", "qwen2_moe"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(hf_config(arch)).float().eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1 + 0.2 * torch.randn_like(p))
                elif p.ndim == 1:
                    p.copy_(0.1 * torch.randn_like(p))
                else:
                    p.normal_(0, p.shape[-1] ** -0.5)
        folder = tmp_path_factory.mktemp(arch)
        model.save_pretrained(folder)
        tensors = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as sf:
                tensors.update({k: sf.get_tensor(k) for k in sf.keys()})
        out[arch] = (model, tensors)
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_hf_names_are_what_transformers_writes(saved, arch):
    """Experts one tensor each (mlp.experts.<e>.gate_proj.weight ...), the router mlp.gate, the
    shared expert and its gate (Qwen2-MoE); layer 1 (mlp_only_layers) a dense MLP."""
    _, tensors = saved[arch]
    m = mapping_for(hf_config(arch))
    assert sorted(m.hf_names()) == sorted(tensors)
    assert {n: tuple(t.shape) for n, t in tensors.items()} == {n: m.dims.hf_shape(n) for n in tensors}
    assert "model.layers.1.mlp.gate_proj.weight" in tensors
    assert "model.layers.1.mlp.gate.weight" not in tensors
    assert m.dims.moe_layers == frozenset({0, 2, 3})


@pytest.mark.parametrize("tp,pp,ep", LAYOUTS)
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_round_trip_is_exact(saved, arch, tp, pp, ep):
    """HF -> megatron [pp][ep x tp] -> HF gives every tensor back bitwise; each EP rank holds
    only its own experts, as local 0..n-1."""
    _, tensors = saved[arch]
    m = mapping_for(hf_config(arch))
    stages = m.hf_to_megatron(tensors, tp, pp, 4, 128, ep=ep)
    assert len(stages) == pp and all(len(r) == tp * ep for r in stages)
    local = 4 // ep
    first = stages[0][0]
    assert f"decoder.layers.0.mlp.experts.local_experts.{local - 1}.linear_fc1.weight" in first
    assert f"decoder.layers.0.mlp.experts.local_experts.{local}.linear_fc1.weight" not in first
    if ep > 1:   # EP rank 1's local expert 0 is global expert `local`
        up = tensors[f"model.layers.0.mlp.experts.{local}.down_proj.weight"]
        got = stages[0][tp]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"]
        assert torch.equal(got, up.chunk(tp, dim=1)[0])
    back = m.megatron_shards_to_hf(stages, ep=ep)
    assert sorted(back) == sorted(tensors)
    for name, t in tensors.items():
        assert torch.equal(back[name], t), name


def test_ep_not_dividing_the_experts_is_named(saved):
    m = mapping_for(hf_config("qwen3_moe"))
    with pytest.raises(ValueError, match=r"parallel\.ep=3 must divide the model's 4 experts"):
        m.hf_to_megatron(saved["qwen3_moe"][1], 1, 1, 4, 128, ep=3)


def test_missing_expert_tensor_is_named(saved):
    tensors = dict(saved["qwen3_moe"][1])
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing HF parameters.*model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight"):
        mapping_for(hf_config("qwen3_moe")).hf_to_megatron(tensors, 1, 1, 4, 128)


@pytest.mark.parametrize("option,value", [("n_group", 2), ("routed_scaling_factor", 2.5),
                                          ("first_k_dense_replace", 1)])
def test_unsupported_moe_option_is_named(option, value):
    cfg = hf_config("qwen3_moe")
    setattr(cfg, option, value)
    with pytest.raises(ValueError, match=rf"Qwen3MoeForCausalLM with {option}={value}.*config\.json"):
        mapping_for(cfg)


def test_mlp_only_layers_outside_the_model_are_named():
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[7\]"):
        mapping_for(hf_config("qwen3_moe", mlp_only_layers=[7]))


def test_decoder_sparse_step_picks_the_moe_layers():
    m = mapping_for(hf_config("qwen2_moe", decoder_sparse_step=2, mlp_only_layers=[]))
    assert m.dims.moe_layers == frozenset({1, 3})
    names = m.hf_names()
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.1.mlp.gate.weight" in names


@pytest.mark.parametrize("step,mlp_only", [(1, []), (2, []), (1, [0, 2]), (2, [1]), (3, [])])
def test_the_plan_and_the_mapping_agree_on_the_moe_layers(step, mlp_only):
    """The plan sizes memory from models.arch.Arch's dense layers, the trainer builds and maps
    from the mapping's MoE layers: the same layers, each exactly one of the two."""
    cfg = hf_config("qwen2_moe", decoder_sparse_step=step, mlp_only_layers=mlp_only)
    arch = arch_from_hf(cfg.to_dict())
    sparse = mapping_for(cfg).dims.moe_layers
    assert {i for i in range(cfg.num_hidden_layers) if arch.is_sparse(i)} == set(sparse)
    assert set(arch.dense_layers) == set(range(cfg.num_hidden_layers)) - sparse


# ---- against megarl's own megatron model (1 rank, gloo) ---------------------------------

@pytest.fixture(scope="module")
def megatron_world(tmp_path_factory):
    """World size 1 (gloo, TP=PP=EP=1) so megatron-core builds the MoE GPTModel on CPU."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist

    from megarl.distributed import parallel
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    parallel.initialize(1, 1, seed=0)
    try:
        yield
    finally:
        parallel.destroy()
        dist.destroy_process_group()


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_megatron_model_matches_transformers(megatron_world, saved, arch, dispatcher):
    """The trainer's model (transformer_config + build_model: MoE block spec, dense layer 1)
    has exactly the table's names, loads them strictly and gives transformers' logits within
    1e-5 (fp32). The two forwards sum in different orders (measured 1.9e-6 on the feasibility
    probe's Qwen3-MoE); routing a token to another expert moves logits by O(0.1)."""
    from megarl.models.builders import build_model
    from megarl.models.masks import causal_mask
    from megarl.models.transformer_config import transformer_config

    model_hf, tensors = saved[arch]
    cfg = hf_config(arch)
    tcfg = transformer_config(cfg, 1, 1, torch.float32, on_gpu=False, dispatcher=dispatcher)
    gpt, info = build_model(cfg, tcfg, 128, "actor")
    ours = mapping_for(cfg).hf_to_megatron(tensors, 1, 1, 4, info.padded_vocab)[0][0]
    real = {k: tuple(v.shape) for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    assert real == {k: tuple(v.shape) for k, v in ours.items()}
    gpt.load_state_dict(ours, strict=False)
    gpt.eval()
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model_hf(ids).logits
        out = gpt(ids, torch.arange(12).expand(2, 12), causal_mask(12, ids.device))
    torch.testing.assert_close(out[..., :100], ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("tp,pp,ep,dispatcher,setting", [
    (1, 1, 3, "alltoall", r"parallel\.ep=3 must divide the model's 4 experts"),
    (1, 1, 2, "allgather", r"parallel\.moe_dispatcher=allgather needs micro-batches of one shape.*alltoall"),
    (1, 2, 1, "allgather", r"parallel\.moe_dispatcher=allgather needs micro-batches of one shape.*alltoall")])
def test_layouts_megatron_cannot_run_are_named(tp, pp, ep, dispatcher, setting):
    from megarl.models.transformer_config import transformer_config
    with pytest.raises(ValueError, match=setting):
        transformer_config(hf_config("qwen3_moe"), tp, pp, torch.float32, on_gpu=False, ep=ep,
                           dispatcher=dispatcher)
