"""LoRA adapter names and layouts, megatron <-> PEFT (megarl/formats/lora_peft.py): pure."""
import pytest
import torch
from test_conversion_mapping import hf_config

from megarl.formats import lora_peft, ops
from megarl.formats.mapping import mapping_for

R = 3
MODULES = ["self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"]


def adapters(table, layers, tp, seed=0):
    """Random adapters of every target layer as megatron's TP shards {name: shards}, and the
    full weights [out, in] of each layer for the merge."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(layers):
        for m in MODULES:
            module = f"decoder.layers.{i}.{m}"
            row, _ = table.find(module + ".weight")
            rows, cols = lora_peft._full_shape(table, row)
            a, b = torch.randn(R, cols, generator=g), torch.randn(rows, R, generator=g)
            if row.partition_dim == 0:      # column: A whole, B split by the table's own layout
                b_shards = table.to_shards(row, _b_parts(table, row, b), tp, 0)
                out[module] = ([a] * tp, b_shards)
            else:                           # row: A split along its columns, B whole
                out[module] = (ops.split_along(a, 1, tp), [b] * tp)
    return out


def _b_parts(table, row, b):
    """A full B [out, r] read as the HF parts (q, k, v / gate, up) of a fused layer, so that
    table.to_shards lays it out exactly as megatron's fused weight rows."""
    sizes = [table.dims.hf_shape(h)[0] for h in row.hf]
    return list(torch.split(b, sizes, dim=0))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip(arch, tp):
    table = mapping_for(hf_config(arch, num_layers=2))
    mine = adapters(table, 2, tp)
    peft = {}
    for module, (a, b) in mine.items():
        peft.update(lora_peft.to_peft(table, module, a, b))
    assert lora_peft.target_modules(peft) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                              "up_proj", "v_proj"]
    assert "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight" in peft
    back = lora_peft.from_peft(table, peft, tp)
    assert set(back) == {f"{m}.lora_{x}" for m in mine for x in "ab"}
    for module, (a, b) in mine.items():
        for got, want in zip(back[module + ".lora_a"], a):
            assert torch.equal(got, want), module
        for got, want in zip(back[module + ".lora_b"], b):
            assert torch.equal(got, want), module


@pytest.mark.parametrize("tp", [1, 2])
def test_merged_route_equals_adapters_route(tp):
    """base + scale * B A in megatron's layout, converted through the mapping table, equals each
    HF part's base + scale * B_part A_part from the PEFT tensors: the merged and the adapters
    routes give an engine the same weights."""
    table = mapping_for(hf_config("llama", num_layers=2))
    scale = 16 / R
    g = torch.Generator().manual_seed(1)
    for module, (a_shards, b_shards) in adapters(table, 2, tp, seed=2).items():
        row, _ = table.find(module + ".weight")
        rows, cols = lora_peft._full_shape(table, row)
        base = torch.randn(rows, cols, generator=g)
        base_shards = table.to_shards(row, _b_parts(table, row, base) if row.kind != "row" else [base], tp, 0)
        merged = [w + scale * b @ a for w, a, b in zip(base_shards, a_shards, b_shards)]
        hf_merged = table.megatron_to_hf(module + ".weight", merged)
        hf_base = table.megatron_to_hf(module + ".weight", base_shards)
        peft = lora_peft.to_peft(table, module, a_shards, b_shards)
        assert len(hf_merged) == len(row.hf)
        for name, w in hf_merged.items():
            na, nb = lora_peft._peft(name)
            assert torch.allclose(w, hf_base[name] + scale * peft[nb] @ peft[na], atol=1e-5), name


def test_swapped_qkv_split_is_caught():
    """Splitting B's fused rows as plain [q; k; v] blocks instead of by GQA group disagrees with
    the table's split of the weight (the check above would fail on it)."""
    table = mapping_for(hf_config("llama", num_layers=1))
    module = "decoder.layers.0.self_attention.linear_qkv"
    (a, b), = [v for k, v in adapters(table, 1, 1).items() if k == module]
    good = lora_peft.to_peft(table, module, a, b)
    d = table.dims
    q = d.num_heads * d.head_dim
    naive = b[0][:q]
    assert not torch.equal(naive, good["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"])


def test_layer_offset_and_errors():
    table = mapping_for(hf_config("llama", num_layers=4))
    a, b = adapters(table, 1, 1)["decoder.layers.0.mlp.linear_fc2"]
    out = lora_peft.to_peft(table, "decoder.layers.0.mlp.linear_fc2", a, b, layer_offset=2)
    assert set(out) == {"base_model.model.model.layers.2.mlp.down_proj.lora_A.weight",
                        "base_model.model.model.layers.2.mlp.down_proj.lora_B.weight"}
    assert lora_peft.split_name("decoder.layers.3.mlp.linear_fc1.lora_b") == ("decoder.layers.3.mlp.linear_fc1", "b")
    with pytest.raises(ValueError, match="not a LoRA adapter"):
        lora_peft.split_name("decoder.layers.3.mlp.linear_fc1.weight")
    with pytest.raises(ValueError, match="input_layernorm"):
        lora_peft.to_peft(table, "decoder.layers.0.input_layernorm", a, b)
    qkv = adapters(table, 1, 1)["decoder.layers.0.self_attention.linear_qkv"]
    peft = lora_peft.to_peft(table, "decoder.layers.0.self_attention.linear_qkv", *qkv)
    peft["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"] = torch.zeros_like(qkv[0][0])
    with pytest.raises(ValueError, match="different lora_A"):
        lora_peft.from_peft(table, peft)


def test_zero_adapter_and_config(tmp_path):
    table = mapping_for(hf_config("llama", num_layers=2))
    zero = lora_peft.zero_adapter(table, ["qkv", "fc2"], R)
    assert lora_peft.target_modules(zero) == ["down_proj", "k_proj", "q_proj", "v_proj"]
    assert all(not t.any() for t in zero.values())
    assert zero["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"].shape == (R, table.dims.ffn)
    lora_peft.write_adapter(tmp_path, zero, R, 16, "/models/base")
    import json
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["base_model_name_or_path"]) == (R, 16, "/models/base")
    assert cfg["target_modules"] == ["down_proj", "k_proj", "q_proj", "v_proj"]
    assert (tmp_path / "adapter_model.safetensors").is_file()
