"""LoRA adapters: megatron names and layouts <-> PEFT / HF names (pure; no torch.distributed).

The trainer's adapters (megarl/models/lora.py) sit on megatron's fused layers; PEFT, transformers
and vLLM know them per HF linear layer:

| megatron (`decoder.layers.{i}.` ...) | A | B | PEFT (`base_model.model.model.layers.{i}.` ...) |
|---|---|---|---|
| `self_attention.linear_qkv` | [r, H] | [qkv_out, r] | `self_attn.{q,k,v}_proj.lora_{A,B}.weight` |
| `self_attention.linear_proj` | [r, q] | [H, r] | `self_attn.o_proj.lora_{A,B}.weight` |
| `mlp.linear_fc1` | [r, H] | [2F, r] | `mlp.{gate,up}_proj.lora_{A,B}.weight` |
| `mlp.linear_fc2` | [r, F] | [H, r] | `mlp.down_proj.lora_{A,B}.weight` |

A fused layer's A is shared: each of q, k, v (gate, up) gets a copy, since x A^T feeds every part
of B. B's rows split exactly as the mapping table splits the fused weight's rows (`ops`: QKV by
GQA group, fc1 into gate and up per TP rank), so base + scale * B A converted through the table
equals the HF base + scale * B_part A part by part (the merged route and the adapters route
agree). The split kind of a layer is its weight's table row (`mapping.ArchMapping.find`), so every
architecture of the tables is covered. vLLM's LoRA takes q/k/v and gate/up separately and stacks
them itself onto its packed qkv_proj / gate_up_proj (`packed_modules_mapping`).

Layer indices: megatron's are local to a PP stage (`layer_offset` makes them global), PEFT's
global, as in `mapping.py`.
"""
from __future__ import annotations

import json
import re
from typing import Mapping, Sequence

import torch
from torch import Tensor

from megarl.formats import ops
from megarl.formats.mapping import ArchMapping

PEFT_PREFIX = "base_model.model."
#: model.lora.targets' names -> megatron's layer (in a decoder layer)
TARGET_MODULES = {"qkv": "self_attention.linear_qkv", "proj": "self_attention.linear_proj",
                  "fc1": "mlp.linear_fc1", "fc2": "mlp.linear_fc2"}
#: megatron's adapter parameter names: `<layer>.lora_a` / `<layer>.lora_b`
_ADAPTER = re.compile(r"^(decoder\.layers\.(\d+)\..+)\.lora_([ab])$")
_PEFT = re.compile(r"^base_model\.model\.(model\.layers\.(\d+)\..+)\.lora_([AB])\.weight$")


def is_adapter(name: str) -> bool:
    """A megatron adapter parameter (`...linear_qkv.lora_a`, ...)."""
    return _ADAPTER.match(name) is not None


def split_name(name: str) -> tuple[str, str]:
    """`decoder.layers.3.self_attention.linear_qkv.lora_a` -> (the layer's module name, "a")."""
    m = _ADAPTER.match(name)
    if m is None:
        raise ValueError(f"{name!r} is not a LoRA adapter parameter (<layer>.lora_a / <layer>.lora_b)")
    return m.group(1), m.group(3)


def _weight_row(table: ArchMapping, module: str):
    row, local = table.find(module + ".weight")
    if row.kind not in ("qkv", "row", "gate_up", "column"):
        raise ValueError(f"LoRA on {module!r} ({row.kind} weight) is not supported: only the attention "
                         f"and MLP linear layers (linear_qkv, linear_proj, linear_fc1, linear_fc2)")
    return row, local


def _peft(hf_weight: str) -> tuple[str, str]:
    """HF `model.layers.3.self_attn.q_proj.weight` -> its PEFT lora_A and lora_B names."""
    base = PEFT_PREFIX + hf_weight.removesuffix(".weight")
    return base + ".lora_A.weight", base + ".lora_B.weight"


def to_peft(table: ArchMapping, module: str, a_shards: Sequence[Tensor], b_shards: Sequence[Tensor],
            layer_offset: int = 0) -> dict[str, Tensor]:
    """One megatron layer's adapters, given as each TP rank's A and B (a replicated one: one
    tensor or every rank's copy), as PEFT tensors {name: tensor}.

    Column-parallel layers (qkv, fc1) hold A whole and B split along its rows; row-parallel ones
    (proj, fc2) A split along its columns and B whole (megarl/models/lora.py)."""
    row, local = _weight_row(table, module)
    hf_names = [h.format(i=local + layer_offset) for h in row.hf]
    d = table.dims
    if row.kind in ("qkv", "gate_up", "column"):
        a = a_shards[0]
        if row.kind == "qkv":
            bs = ops.qkv_from_megatron(ops.cat_along(b_shards, 0), d.num_heads, d.num_kv_heads, d.head_dim)
        elif row.kind == "gate_up":
            bs = ops.gate_up_from_fc1_shards(list(b_shards))
        else:
            bs = [ops.cat_along(b_shards, 0)]
        out = {}
        for h, b in zip(hf_names, bs):
            na, nb = _peft(h)
            out[na], out[nb] = a.clone(), b.contiguous()    # each part its own copy of the shared A
        return out
    na, nb = _peft(hf_names[0])
    return {na: ops.cat_along(a_shards, 1), nb: b_shards[0]}


def from_peft(table: ArchMapping, peft: Mapping[str, Tensor], tp: int = 1) -> dict[str, list[Tensor]]:
    """Inverse of `to_peft` over a whole adapter (global layer indices, one PP stage holding
    every layer): {megatron adapter name: its TP shards}. A fused layer's parts must share one A
    (PEFT adapters trained per HF layer generally do not: ValueError naming the layer)."""
    modules: dict[str, dict[str, Tensor]] = {}
    for name, t in peft.items():
        m = _PEFT.match(name)
        if m is None:
            raise ValueError(f"{name!r} is not a PEFT LoRA tensor (base_model.model.<layer>.lora_A/B.weight)")
        modules.setdefault(m.group(1) + ".weight", {})[m.group(3)] = t
    hf_to_row = {h: row for row in table.table if row.kind in ("qkv", "gate_up", "row", "column")
                 and row.per_layer and not row.per_expert for h in row.hf}
    out: dict[str, list[Tensor]] = {}
    done = set()
    d = table.dims
    for hf_weight in sorted(modules):
        layer = int(hf_weight.split(".")[2])
        row = hf_to_row.get(hf_weight.replace(f"layers.{layer}.", "layers.{i}.", 1))
        if row is None:
            raise ValueError(f"PEFT adapter on {hf_weight.removesuffix('.weight')!r}: no megatron layer maps it")
        module = row.megatron.format(i=layer).removesuffix(".weight")
        if module in done:
            continue
        done.add(module)
        parts = [modules.get(h.format(i=layer)) for h in row.hf]
        if any(p is None or set(p) != {"A", "B"} for p in parts):
            raise ValueError(f"PEFT adapter of {module!r}: needs lora_A and lora_B of each of "
                             f"{[h.format(i=layer) for h in row.hf]}")
        a = parts[0]["A"]
        if any(not torch.equal(p["A"], a) for p in parts[1:]):
            raise ValueError(f"PEFT adapter of {module!r}: the parts {[h.format(i=layer) for h in row.hf]} have "
                             f"different lora_A, which megatron's fused layer (one A) cannot hold")
        bs = [p["B"] for p in parts]
        if row.kind == "qkv":
            b_shards = ops.qkv_shards(ops.qkv_to_megatron(*bs, d.num_heads, d.num_kv_heads, d.head_dim),
                                      d.num_kv_heads, tp)
            a_shards = [a] * tp
        elif row.kind == "gate_up":
            b_shards, a_shards = ops.fc1_shards_from_gate_up(bs[0], bs[1], tp), [a] * tp
        elif row.kind == "column":
            b_shards, a_shards = ops.split_along(bs[0], 0, tp), [a] * tp
        else:
            a_shards, b_shards = ops.split_along(a, 1, tp), [bs[0]] * tp
        out[module + ".lora_a"], out[module + ".lora_b"] = a_shards, b_shards
    return out


def target_modules(names) -> list[str]:
    """PEFT's `target_modules`: the HF linear layers the adapter's tensors name (q_proj, ...)."""
    return sorted({n.removesuffix(".lora_A.weight").removesuffix(".lora_B.weight").rsplit(".", 1)[-1]
                   for n in names})


def adapter_config(rank: int, alpha: float, targets: list[str], base_model: str) -> dict:
    """PEFT's adapter_config.json for a plain LoRA adapter (what peft, transformers and vLLM read)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(rank), "lora_alpha": alpha,
            "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
            "base_model_name_or_path": base_model, "inference_mode": True}


def write_adapter(folder, tensors: Mapping[str, Tensor], rank: int, alpha: float, base_model: str) -> None:
    """A PEFT adapter folder: adapter_config.json and adapter_model.safetensors."""
    from pathlib import Path

    from safetensors.torch import save_file
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    config = adapter_config(rank, alpha, target_modules(tensors), base_model)
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def zero_adapter(table: ArchMapping, targets: list[str], rank: int, dtype=torch.float32) -> dict[str, Tensor]:
    """PEFT tensors of an adapter whose B is zero on every `targets` layer (megatron's names: the
    model.lora.targets' layers), every layer: an adapted model equal to its base, as the
    trainer's adapters start (B zeros)."""
    d = table.dims
    out = {}
    for i in range(d.num_layers):
        for t in targets:
            module = f"decoder.layers.{i}.{TARGET_MODULES[t]}"
            row, _ = _weight_row(table, module)
            rows, cols = _full_shape(table, row)
            a = torch.zeros(rank, cols, dtype=dtype)
            b = torch.zeros(rows, rank, dtype=dtype)
            out.update(to_peft(table, module, [a], [b]))
    return out


def _full_shape(table: ArchMapping, row) -> tuple[int, int]:
    """A layer's full megatron weight [out, in]."""
    shapes = [table.dims.hf_shape(h) for h in row.hf]
    return sum(s[0] for s in shapes), shapes[0][1]
