"""The HF <-> megatron-core parameter tables, one per architecture, and the model sizes they
are bound to (`ModelDims`); `megarl.formats.mapping` applies them. Pure data and shapes: no
torch.distributed, no megatron.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from megarl.formats import experts as moe

Kind = Literal["replicated", "column", "row", "vocab", "qkv", "gate_up"]

# The dim TP splits for each kind (None: every TP rank holds the full tensor).
_PARTITION_DIM: dict[str, int | None] = {
    "replicated": None, "column": 0, "row": 1, "vocab": 0, "qkv": 0, "gate_up": 0}


@dataclass(frozen=True)
class ParamMapping:
    """One megatron parameter and the HF parameter(s) it holds.

    `megatron` and `hf` are name templates; "{i}" is the layer index (stage-local for megatron,
    global for HF), "{e}" an expert's index (local to its expert-parallel rank for megatron,
    global for HF). `hf` has 3 names (q, k, v) for kind "qkv", 2 (gate, up) for "gate_up", else 1.
    `mlp`: the layers a per-layer row exists in: "any", "dense" (a dense MLP) or "moe" (an MoE
    block: router, experts, shared expert).
    """
    megatron: str
    hf: tuple[str, ...]
    kind: Kind
    mlp: Literal["any", "dense", "moe"] = "any"

    def __post_init__(self):
        n = {"qkv": 3, "gate_up": 2}.get(self.kind, 1)
        if self.kind not in _PARTITION_DIM or len(self.hf) != n:
            raise ValueError(f"bad mapping row {self}: kind {self.kind!r} needs {n} HF names")

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.megatron

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.megatron

    @property
    def partition_dim(self) -> int | None:
        return _PARTITION_DIM[self.kind]

    def in_layer(self, moe_layer: bool) -> bool:
        return self.mlp == "any" or (self.mlp == "moe") == moe_layer


_L, _HL = "decoder.layers.{i}.", "model.layers.{i}."

LLAMA_TABLE: tuple[ParamMapping, ...] = (
    ParamMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    ParamMapping(_L + "input_layernorm.weight", (_HL + "input_layernorm.weight",), "replicated"),
    ParamMapping(_L + "self_attention.linear_qkv.weight",
                 (_HL + "self_attn.q_proj.weight", _HL + "self_attn.k_proj.weight",
                  _HL + "self_attn.v_proj.weight"), "qkv"),
    ParamMapping(_L + "self_attention.linear_proj.weight", (_HL + "self_attn.o_proj.weight",), "row"),
    ParamMapping(_L + "pre_mlp_layernorm.weight", (_HL + "post_attention_layernorm.weight",),
                 "replicated"),
    ParamMapping(_L + "mlp.linear_fc1.weight",
                 (_HL + "mlp.gate_proj.weight", _HL + "mlp.up_proj.weight"), "gate_up", "dense"),
    ParamMapping(_L + "mlp.linear_fc2.weight", (_HL + "mlp.down_proj.weight",), "row", "dense"),
    ParamMapping("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"),
    ParamMapping("output_layer.weight", ("lm_head.weight",), "vocab"),
)
QWEN2_TABLE: tuple[ParamMapping, ...] = LLAMA_TABLE + (
    ParamMapping(_L + "self_attention.linear_qkv.bias",
                 (_HL + "self_attn.q_proj.bias", _HL + "self_attn.k_proj.bias",
                  _HL + "self_attn.v_proj.bias"), "qkv"),
)
MISTRAL_TABLE: tuple[ParamMapping, ...] = LLAMA_TABLE
# Qwen3: RMSNorm over each head's query and key (head_dim wide, shared by the heads) before RoPE;
# megatron's qk_layernorm holds the same weight, on every TP rank
QWEN3_TABLE: tuple[ParamMapping, ...] = LLAMA_TABLE + (
    ParamMapping(_L + "self_attention.q_layernorm.weight", (_HL + "self_attn.q_norm.weight",),
                 "replicated"),
    ParamMapping(_L + "self_attention.k_layernorm.weight", (_HL + "self_attn.k_norm.weight",),
                 "replicated"),
)

# An MoE block: the router (one logit row per expert, on every TP rank) and each routed expert's
# SwiGLU MLP, experts split over expert-parallel ranks and each expert's MLP over TP as a dense one
_X = _L + "mlp.experts.local_experts.{e}."
_HX = _HL + "mlp.experts.{e}."
EXPERT_ROWS: tuple[ParamMapping, ...] = (
    ParamMapping(_L + "mlp.router.weight", (_HL + "mlp.gate.weight",), "replicated", "moe"),
    ParamMapping(_X + "linear_fc1.weight", (_HX + "gate_proj.weight", _HX + "up_proj.weight"),
                 "gate_up", "moe"),
    ParamMapping(_X + "linear_fc2.weight", (_HX + "down_proj.weight",), "row", "moe"),
)
# Qwen2-MoE: a shared expert beside the routed ones, its output scaled by sigmoid(gate . x)
_S, _HS = _L + "mlp.shared_experts.", _HL + "mlp.shared_expert."
SHARED_EXPERT_ROWS: tuple[ParamMapping, ...] = (
    ParamMapping(_S + "linear_fc1.weight", (_HS + "gate_proj.weight", _HS + "up_proj.weight"),
                 "gate_up", "moe"),
    ParamMapping(_S + "linear_fc2.weight", (_HS + "down_proj.weight",), "row", "moe"),
    ParamMapping(_S + "gate_weight", (_HL + "mlp.shared_expert_gate.weight",), "replicated", "moe"),
)
QWEN3_MOE_TABLE: tuple[ParamMapping, ...] = QWEN3_TABLE + EXPERT_ROWS
QWEN2_MOE_TABLE: tuple[ParamMapping, ...] = QWEN2_TABLE + EXPERT_ROWS + SHARED_EXPERT_ROWS

TABLES: dict[str, tuple[ParamMapping, ...]] = {
    "LlamaForCausalLM": LLAMA_TABLE,
    "Qwen2ForCausalLM": QWEN2_TABLE,
    "MistralForCausalLM": MISTRAL_TABLE,
    "Qwen3ForCausalLM": QWEN3_TABLE,
    "Qwen3MoeForCausalLM": QWEN3_MOE_TABLE,
    "Qwen2MoeForCausalLM": QWEN2_MOE_TABLE,
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}

# The Transformer Engine spec fuses the norms into the following linear layer.
TE_NAMES = {
    _L + "input_layernorm.weight": _L + "self_attention.linear_qkv.layer_norm_weight",
    _L + "pre_mlp_layernorm.weight": _L + "mlp.linear_fc1.layer_norm_weight",
}

# HF keys that carry no weights (non-persistent buffers saved by old transformers versions).
_HF_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_OUTPUT = "output_layer.weight"
_TIED_OUTPUT = ParamMapping(_OUTPUT, ("model.embed_tokens.weight",), "vocab")
_MCORE_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+|\{i\})\.(.+)$")
_MCORE_EXPERT = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)(\..+)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+|\{e\})\.")


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocab: `vocab` rounded up to a multiple of divisible_by * tp."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab / multiple) * multiple)


def is_extra_state(name: str) -> bool:
    """True for megatron/TE `_extra_state` keys (fp8 metadata), which hold no weights."""
    return name.endswith("_extra_state")


@dataclass(frozen=True)
class ModelDims:
    """The sizes the mapping needs, read from an HF config."""
    hidden: int
    ffn: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    num_layers: int
    tied: bool
    num_experts: int = 0          # routed experts per MoE layer (0: dense)
    moe_ffn: int = 0              # one routed expert's intermediate size
    shared_ffn: int = 0           # the shared expert's intermediate size (Qwen2-MoE)
    moe_layers: frozenset = frozenset()   # global indices of the MoE layers

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelDims":
        heads = cfg.num_attention_heads
        return cls(hidden=cfg.hidden_size, ffn=cfg.intermediate_size, num_heads=heads,
                   num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                   vocab=cfg.vocab_size, num_layers=cfg.num_hidden_layers,
                   tied=bool(getattr(cfg, "tie_word_embeddings", False)),
                   num_experts=moe.num_experts(cfg),
                   moe_ffn=int(getattr(cfg, "moe_intermediate_size", 0) or 0),
                   shared_ffn=int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0),
                   moe_layers=moe.moe_layers(cfg))

    def hf_shape(self, template: str) -> tuple[int, ...]:
        """Full HF shape of the parameter named by `template` (layer index "{i}" or a number)."""
        H, F, d = self.hidden, self.ffn, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        suffix = _HF_LAYER.sub(r"\2", template)
        expert = _HF_EXPERT.match(suffix)
        if expert:   # a routed expert: a SwiGLU MLP of moe_ffn
            F, suffix = self.moe_ffn, _HF_EXPERT.sub("mlp.", suffix)
        elif suffix.startswith("mlp.shared_expert."):
            F, suffix = self.shared_ffn, suffix.replace("mlp.shared_expert.", "mlp.")
        return {
            "mlp.gate.weight": (self.num_experts, H), "mlp.shared_expert_gate.weight": (1, H),
            "model.embed_tokens.weight": (self.vocab, H), "lm_head.weight": (self.vocab, H),
            "model.norm.weight": (H,), "input_layernorm.weight": (H,),
            "post_attention_layernorm.weight": (H,),
            "self_attn.q_proj.weight": (q, H), "self_attn.k_proj.weight": (kv, H),
            "self_attn.v_proj.weight": (kv, H), "self_attn.q_proj.bias": (q,),
            "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
            "self_attn.o_proj.weight": (H, q),
            "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
            "mlp.gate_proj.weight": (F, H), "mlp.up_proj.weight": (F, H),
            "mlp.down_proj.weight": (H, F),
        }[suffix]
