"""Contracts of the HF <-> megatron-core mapping (megarl.conversion).

Tensors are `torch.arange` based (every element unique), so any permutation of rows, heads or
shards shows up as a `torch.equal` failure.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megarl.formats import ops
from megarl.formats.mapping import mapping_for, padded_vocab_size

transformers = pytest.importorskip("transformers")

HID, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 32, 64, 4, 4, 2, 100
DIVISIBLE_BY = 64  # padded vocab 128 at tp 1 and 2: 28 padding rows
TP_PP = [(1, 1), (2, 1), (1, 2), (2, 2)]
QWEN3_HEAD_DIM = 16
ARCHS = ["llama", "qwen2", "mistral", "qwen3"]


def arange(*shape, start=0):
    n = 1
    for s in shape:
        n *= s
    return torch.arange(start, start + n, dtype=torch.float32).reshape(shape)


def hf_config(arch: str, num_layers: int = LAYERS):
    kw = dict(hidden_size=HID, intermediate_size=FFN, num_hidden_layers=num_layers,
              num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB)
    if arch == "llama":
        return transformers.LlamaConfig(tie_word_embeddings=False, **kw)
    if arch == "qwen2":
        return transformers.Qwen2Config(tie_word_embeddings=True, **kw)
    if arch == "qwen3":  # QK norm; head_dim 16 apart from hidden / heads = 8
        return transformers.Qwen3Config(tie_word_embeddings=False, head_dim=QWEN3_HEAD_DIM, **kw)
    return transformers.MistralConfig(tie_word_embeddings=False, **kw)


def hf_state_dict(cfg) -> dict[str, torch.Tensor]:
    """The transformers model's own state-dict keys/shapes, refilled with unique values."""
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    sd, start = {}, 0
    for name, t in model.state_dict().items():
        sd[name] = arange(*t.shape, start=start)
        start += t.numel()
    if cfg.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


def expected_hf(cfg, sd):
    return {k: v for k, v in sd.items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}


def assert_same(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ---- ops ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_split_cat_round_trip(tp, dim):
    """cat_along(split_along(t, dim, tp), dim) == t, and shards are contiguous slices in order."""
    t = arange(8, 12)
    shards = ops.split_along(t, dim, tp)
    assert len(shards) == tp and all(s.shape[dim] == t.shape[dim] // tp for s in shards)
    assert torch.equal(shards[-1], t.narrow(dim, t.shape[dim] - t.shape[dim] // tp, t.shape[dim] // tp))
    assert torch.equal(ops.cat_along(shards, dim), t)


def test_split_along_rejects_uneven():
    """Splitting a size that tp does not divide raises, naming the size and tp."""
    with pytest.raises(ValueError, match=r"size 6.*tp=4"):
        ops.split_along(arange(6, 2), 0, 4)


def test_pad_unpad_vocab():
    """pad_vocab appends zero rows; unpad_vocab removes exactly them."""
    t = arange(100, 3)
    padded = ops.pad_vocab(t, 128)
    assert padded.shape == (128, 3) and torch.equal(padded[100:], torch.zeros(28, 3))
    assert torch.equal(ops.unpad_vocab(padded, 100), t)
    with pytest.raises(ValueError, match="smaller than the vocab size 100"):
        ops.pad_vocab(t, 99)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_padded_vocab_size(tp):
    """Padded vocab is the vocab rounded up to a multiple of divisible_by * tp."""
    assert padded_vocab_size(100, 64, tp) == {1: 128, 2: 128, 4: 256}[tp]
    assert padded_vocab_size(32000, 128, 8) == 32768
    assert padded_vocab_size(1024, 128, 8) == 1024


def test_qkv_megatron_layout_hand_written():
    """2 KV groups x 2 q heads, head_dim 1: megatron order is q0 q1 k0 v0 | q2 q3 k1 v1."""
    q, k, v = torch.tensor([0., 1., 2., 3.]), torch.tensor([10., 11.]), torch.tensor([20., 21.])
    fused = ops.qkv_to_megatron(q, k, v, num_heads=4, num_kv_heads=2, head_dim=1)
    assert fused.tolist() == [0., 1., 10., 20., 2., 3., 11., 21.]
    shards = ops.qkv_shards(fused, num_kv_heads=2, tp=2)
    assert [s.tolist() for s in shards] == [[0., 1., 10., 20.], [2., 3., 11., 21.]]
    # weights: rows move as units, the hidden dim is untouched
    fused_w = ops.qkv_to_megatron(q[:, None] * torch.ones(4, 3), k[:, None] * torch.ones(2, 3),
                                  v[:, None] * torch.ones(2, 3), 4, 2, 1)
    assert fused_w[:, 0].tolist() == [0., 1., 10., 20., 2., 3., 11., 21.]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_round_trip(num_heads, num_kv_heads, bias, tp):
    """HF q/k/v -> fused -> TP shards (whole GQA groups) -> merged -> q/k/v is exact (GQA and MHA)."""
    d, rest = 3, (() if bias else (5,))
    q = arange(num_heads * d, *rest)
    k = arange(num_kv_heads * d, *rest, start=1000)
    v = arange(num_kv_heads * d, *rest, start=2000)
    fused = ops.qkv_to_megatron(q, k, v, num_heads, num_kv_heads, d)
    assert fused.shape == ((num_heads + 2 * num_kv_heads) * d, *rest)
    if num_kv_heads % tp:
        with pytest.raises(ValueError, match=rf"num_kv_heads={num_kv_heads}.*tp={tp}"):
            ops.qkv_shards(fused, num_kv_heads, tp)
        return
    shards = ops.qkv_shards(fused, num_kv_heads, tp)
    # each rank's shard is itself a valid fused qkv of its own heads
    per = num_kv_heads // tp
    for r, s in enumerate(shards):
        q_r, k_r, v_r = ops.qkv_from_megatron(s, num_heads // tp, per, d)
        assert torch.equal(k_r, k[r * per * d:(r + 1) * per * d])
        assert torch.equal(q_r, q[r * num_heads // tp * d:(r + 1) * num_heads // tp * d])
        assert torch.equal(v_r, v[r * per * d:(r + 1) * per * d])
    q2, k2, v2 = ops.qkv_from_megatron(ops.cat_along(shards, 0), num_heads, num_kv_heads, d)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gate_up_round_trip(tp):
    """fc1 shard r == cat(gate_r, up_r), and gate_up_from_fc1_shards inverts it exactly."""
    gate, up = arange(16, 6), arange(16, 6, start=1000)
    shards = ops.fc1_shards_from_gate_up(gate, up, tp)
    for r, s in enumerate(shards):
        assert torch.equal(s, torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]]))
    g2, u2 = ops.gate_up_from_fc1_shards(shards)
    assert torch.equal(g2, gate) and torch.equal(u2, up)


def test_chunking_fused_fc1_is_detected_at_tp2():
    """The classic bug (chunk cat([gate, up]) over TP) gives different shards and a wrong round trip."""
    gate, up = arange(8, 4), arange(8, 4, start=1000)
    naive = ops.split_along(torch.cat([gate, up]), 0, 2)
    good = ops.fc1_shards_from_gate_up(gate, up, 2)
    assert not torch.equal(naive[0], good[0])
    g2, u2 = ops.gate_up_from_fc1_shards(naive)
    assert not torch.equal(g2, gate) and not torch.equal(u2, up)


def test_swapped_gate_up_mapping_is_detected():
    """A table with gate and up swapped breaks the HF -> megatron -> HF round trip on exactly gate/up."""
    cfg = hf_config("llama")
    good = mapping_for(cfg)
    swapped_rows = tuple(dataclasses.replace(m, hf=m.hf[::-1]) if m.kind == "gate_up" else m
                         for m in good.table)
    bad = dataclasses.replace(good, table=swapped_rows)
    sd = hf_state_dict(cfg)
    back = good.megatron_shards_to_hf(bad.hf_to_megatron(sd, 2, 1, LAYERS, 128))
    differ = sorted(k for k in back if not torch.equal(back[k], sd[k]))
    assert differ and all(k.endswith(("gate_proj.weight", "up_proj.weight")) for k in differ)
    assert len(differ) == 2 * LAYERS


# ---- mapping -----------------------------------------------------------------------------

@pytest.mark.parametrize("tp,pp", TP_PP)
@pytest.mark.parametrize("arch", ARCHS)
def test_state_dict_round_trip(arch, tp, pp):
    """HF -> megatron [pp][tp] -> HF is bitwise exact (Llama untied, Qwen2 biases + tied, Mistral,
    Qwen3 QK norms with head_dim apart from hidden / heads)."""
    cfg = hf_config(arch)
    m = mapping_for(cfg)
    sd = hf_state_dict(cfg)
    pv = padded_vocab_size(VOCAB, DIVISIBLE_BY, tp)
    stages = m.hf_to_megatron(sd, tp=tp, pp=pp, num_layers=LAYERS, padded_vocab=pv)
    assert len(stages) == pp and all(len(ranks) == tp for ranks in stages)
    first = stages[0][0]
    assert first["embedding.word_embeddings.weight"].shape == (pv // tp, HID)
    assert f"decoder.layers.{LAYERS // pp - 1}.mlp.linear_fc1.weight" in first
    assert f"decoder.layers.{LAYERS // pp}.mlp.linear_fc1.weight" not in first
    assert ("decoder.final_layernorm.weight" in first) == (pp == 1)
    assert_same(m.megatron_shards_to_hf(stages), expected_hf(cfg, sd))


def test_megatron_to_hf_applies_layer_offset():
    """A PP stage's local layer 0 with layer_offset 2 becomes HF layer 2."""
    m = mapping_for(hf_config("llama"))
    out = m.megatron_to_hf("decoder.layers.0.mlp.linear_fc2.weight",
                           ops.split_along(arange(HID, FFN), 1, 2), layer_offset=2)
    assert list(out) == ["model.layers.2.mlp.down_proj.weight"]
    assert torch.equal(out["model.layers.2.mlp.down_proj.weight"], arange(HID, FFN))


def test_replicated_param_accepts_one_tensor():
    """Replicated params (norms) convert from a single tensor, as weight sync sends them ungathered."""
    m = mapping_for(hf_config("llama"))
    out = m.megatron_to_hf("decoder.final_layernorm.weight", [arange(HID)])
    assert torch.equal(out["model.norm.weight"], arange(HID))


def test_partition_dim():
    """TP split dims: column/qkv/fc1/vocab on 0, row on 1, norms replicated (None)."""
    m = mapping_for(hf_config("qwen2"))
    assert m.partition_dim("embedding.word_embeddings.weight") == 0
    assert m.partition_dim("decoder.layers.3.self_attention.linear_qkv.weight") == 0
    assert m.partition_dim("decoder.layers.3.self_attention.linear_qkv.bias") == 0
    assert m.partition_dim("decoder.layers.3.self_attention.linear_proj.weight") == 1
    assert m.partition_dim("decoder.layers.0.mlp.linear_fc1.weight") == 0
    assert m.partition_dim("decoder.layers.0.mlp.linear_fc2.weight") == 1
    assert m.partition_dim("decoder.layers.0.input_layernorm.weight") is None
    assert m.partition_dim("decoder.final_layernorm.weight") is None
    assert m.partition_dim("output_layer.weight") == 0  # tied duplicate on the last PP stage


def test_tied_output_duplicate_on_last_stage():
    """Tied embeddings at PP=2: the last stage holds output_layer.weight (= embedding); it maps to nothing."""
    cfg = hf_config("qwen2")
    m = mapping_for(cfg)
    sd = hf_state_dict(cfg)
    stages = m.hf_to_megatron(sd, tp=2, pp=2, num_layers=LAYERS, padded_vocab=128)
    for r in range(2):
        assert torch.equal(stages[1][r]["output_layer.weight"],
                           stages[0][r]["embedding.word_embeddings.weight"])
    assert m.megatron_to_hf("output_layer.weight", [stages[1][0]["output_layer.weight"]] * 2) == {}
    assert "output_layer.weight" not in m.hf_to_megatron(sd, 1, 1, LAYERS, 128)[0][0]


def test_te_names():
    """te_names=True renames only the two norms to TE's fused layer_norm_weight names."""
    cfg = hf_config("llama")
    local = mapping_for(cfg).megatron_names(1, True, True)
    te = mapping_for(cfg, te_names=True).megatron_names(1, True, True)
    assert sorted(set(te) - set(local)) == ["decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
                                            "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"]
    assert sorted(set(local) - set(te)) == ["decoder.layers.0.input_layernorm.weight",
                                            "decoder.layers.0.pre_mlp_layernorm.weight"]
    sd = hf_state_dict(cfg)
    m = mapping_for(cfg, te_names=True)
    assert_same(m.megatron_shards_to_hf(m.hf_to_megatron(sd, 2, 2, LAYERS, 128)), sd)


def test_te_names_agree_with_megatron_spec():
    """Our TE names equal megatron's own local->TE key map (sharded_state_dict_keys_map)."""
    specs = pytest.importorskip("megatron.core.models.gpt.gpt_layer_specs")
    keys_map = specs.get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map
    cfg = hf_config("qwen2")
    converted = set()
    for name in mapping_for(cfg).megatron_names(2, True, True):
        for old, new in keys_map.items():
            name = name.replace("." + old, "." + new)
        converted.add(name)
    assert converted == set(mapping_for(cfg, te_names=True).megatron_names(2, True, True))


# ---- errors ------------------------------------------------------------------------------

def test_unknown_architecture_is_named():
    """An unsupported architecture raises naming it and listing the supported ones."""
    cfg = hf_config("llama")
    cfg.architectures = ["GPTNeoXForCausalLM"]
    with pytest.raises(ValueError, match=r"GPTNeoXForCausalLM.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        mapping_for(cfg)


@pytest.mark.parametrize("option", ["use_sliding_window", "attention_bias"])
def test_unsupported_config_option_is_named(option):
    """A config.json option the table cannot reproduce is refused naming the option."""
    cfg = hf_config("qwen3")
    setattr(cfg, option, True)
    with pytest.raises(ValueError, match=rf"Qwen3ForCausalLM with {option}=true.*config\.json"):
        mapping_for(cfg)


def test_unknown_megatron_name_is_named():
    """An unknown megatron parameter raises with its name."""
    m = mapping_for(hf_config("llama"))
    with pytest.raises(ValueError, match=r"decoder\.layers\.0\.mlp\.linear_fc3\.weight"):
        m.megatron_to_hf("decoder.layers.0.mlp.linear_fc3.weight", [arange(2, 2)])
    with pytest.raises(ValueError, match=r"decoder\.layers\.1\.self_attention\.linear_qkv\.bias"):
        m.partition_dim("decoder.layers.1.self_attention.linear_qkv.bias")  # Llama has no qkv bias


def test_megatron_shard_shape_mismatch_is_named():
    """A TP shard of the wrong shape raises with the parameter name and both shapes."""
    m = mapping_for(hf_config("llama"))
    with pytest.raises(ValueError, match=r"linear_fc1\.weight.*\(64, 32\).*\(32, 32\)"):
        m.megatron_to_hf("decoder.layers.0.mlp.linear_fc1.weight", [arange(64, 32)] * 4)
    with pytest.raises(ValueError, match=r"linear_qkv\.weight.*num_kv_heads=2.*tp=4"):
        m.megatron_to_hf("decoder.layers.0.self_attention.linear_qkv.weight", [arange(16, 32)] * 4)


def test_hf_errors_are_named():
    """Unknown, missing and mis-shaped HF tensors raise naming the parameter (and shapes)."""
    cfg = hf_config("llama")
    m = mapping_for(cfg)
    sd = hf_state_dict(cfg)
    with pytest.raises(ValueError, match=r"unknown HF parameter 'model\.layers\.0\.mlp\.extra\.weight'"):
        m.hf_to_megatron({**sd, "model.layers.0.mlp.extra.weight": arange(2)}, 1, 1, LAYERS, 128)
    with pytest.raises(ValueError, match=r"missing HF parameters.*model\.layers\.3\.mlp\.up_proj\.weight"):
        m.hf_to_megatron({k: v for k, v in sd.items() if k != "model.layers.3.mlp.up_proj.weight"},
                         1, 1, LAYERS, 128)
    bad = {**sd, "model.layers.1.self_attn.k_proj.weight": arange(32, 32)}
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.k_proj\.weight'.*\(32, 32\).*\(16, 32\)"):
        m.hf_to_megatron(bad, 1, 1, LAYERS, 128)


def test_layout_errors_name_the_setting():
    """Uneven PP, too-small padded vocab and stage dicts with missing names raise naming the values."""
    cfg = hf_config("llama")
    m = mapping_for(cfg)
    sd = hf_state_dict(cfg)
    with pytest.raises(ValueError, match=r"num_layers=4.*pp=3"):
        m.hf_to_megatron(sd, 1, 3, LAYERS, 128)
    with pytest.raises(ValueError, match=r"padded_vocab=64.*vocab_size=100"):
        m.hf_to_megatron(sd, 1, 1, LAYERS, 64)
    stages = m.hf_to_megatron(sd, 1, 2, LAYERS, 128)
    del stages[1][0]["decoder.final_layernorm.weight"]
    with pytest.raises(ValueError, match=r"missing \['decoder\.final_layernorm\.weight'\]"):
        m.megatron_shards_to_hf(stages)


# ---- against the real megatron-core GPTModel ---------------------------------------------

@pytest.fixture(scope="module")
def megatron_world(tmp_path_factory):
    """World size 1 (gloo, TP=PP=1) so megatron-core builds a GPTModel on CPU."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    with pytest.MonkeyPatch.context() as mp:
        # GlobalMemoryBuffer allocates on torch.cuda.current_device() in the forward pass
        mp.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
        store = tmp_path_factory.mktemp("pg") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        # attention dropout forks the "CUDA" rng tracker; the inference tracker's fork is a no-op
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        try:
            yield
        finally:
            initialize_rng_tracker(force_reset=True)
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def build_gpt(cfg, num_layers, padded_vocab, pre_process=True, post_process=True):
    """A local-spec megatron GPTModel with the HF config's architecture."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    tc = TransformerConfig(
        num_layers=num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads,
        kv_channels=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        qk_layernorm=cfg.model_type == "qwen3", normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=cfg.model_type == "qwen2", use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=tc.qk_layernorm)
    return GPTModel(config=tc, transformer_layer_spec=spec,
                    vocab_size=padded_vocab, max_sequence_length=64, pre_process=pre_process,
                    post_process=post_process, position_embedding_type="rope",
                    rotary_base=int(cfg.rope_parameters["rope_theta"]),
                    share_embeddings_and_output_weights=cfg.tie_word_embeddings)


@pytest.mark.parametrize("arch", ARCHS)
def test_names_match_real_gpt_model(megatron_world, arch):
    """Each PP stage's names+shapes from hf_to_megatron equal a real GPTModel stage's state dict."""
    cfg = hf_config(arch)
    stages = mapping_for(cfg).hf_to_megatron(hf_state_dict(cfg), tp=1, pp=2, num_layers=LAYERS,
                                             padded_vocab=128)
    full = mapping_for(cfg).hf_to_megatron(hf_state_dict(cfg), 1, 1, LAYERS, 128)[0][0]
    for ours, pre, post in ((stages[0][0], True, False), (stages[1][0], False, True),
                            (full, True, True)):
        layers = LAYERS if pre and post else LAYERS // 2
        real = {k: tuple(v.shape) for k, v in build_gpt(cfg, layers, 128, pre, post).state_dict().items()
                if not k.endswith("_extra_state")}
        assert real == {k: tuple(v.shape) for k, v in ours.items()}, (arch, pre, post)


@pytest.mark.parametrize("arch", ARCHS)
def test_real_gpt_model_logits_match_hf(megatron_world, arch):
    """Converted weights loaded (strict) into a real GPTModel give the HF model's logits (atol 1e-5).
    The two models' kernels sum in different orders: 6.6e-7 at most (logits up to 1.8; at 1 and
    2 threads, with MKL_CBWR=COMPATIBLE and ATEN_CPU_CAPABILITY=default); two rows of the first
    MLP weight swapped move them by 6e-2 or more."""
    cfg = hf_config(arch)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)  # norms too, so a swapped norm would show
    gpt = build_gpt(cfg, LAYERS, 128).eval()
    gpt.load_state_dict(mapping_for(cfg).hf_to_megatron(hf.state_dict(), 1, 1, LAYERS, 128)[0][0],
                        strict=True)
    ids = torch.randint(0, VOCAB, (2, 8))
    causal = torch.triu(torch.ones(1, 1, 8, 8, dtype=torch.bool), diagonal=1)  # True = masked
    with torch.no_grad():
        ref = hf(ids).logits
        out = gpt(ids, torch.arange(8).expand(2, 8), causal)
    assert out.shape == (2, 8, 128)
    torch.testing.assert_close(out[..., :VOCAB], ref, rtol=0, atol=1e-5)
