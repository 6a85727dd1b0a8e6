"""The decoder facts of a recipe's model (`Arch`): from the recipe's model.arch or from the
checkpoint's config.json, and the check that the two agree.

`megarl plan` sizes memory from these facts (megarl/plan/memory.py); a run whose recipe states
model.arch checks them against the checkpoint it loads (models/setup.build_all), so the plan
was made for the model that runs. Pure: no torch, no megatron.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from megarl.config.schema import ConfigError, RootConfig
from megarl.formats.experts import sparse_layer_indices


@dataclass(frozen=True)
class Arch:
    """The decoder facts memory depends on (HF config.json names in comments)."""
    hidden: int          # hidden_size
    layers: int          # num_hidden_layers
    heads: int           # num_attention_heads
    kv_heads: int        # num_key_value_heads
    head_dim: int        # head_dim or hidden / heads
    ffn: int             # intermediate_size (SwiGLU)
    vocab: int           # vocab_size
    max_positions: int = 0
    tied: bool = False   # tie_word_embeddings
    qkv_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of queries and keys (Qwen3)
    # Mixture of Experts; 0 / () for a dense model
    experts: int = 0       # num_experts (Qwen2/3-MoE), num_local_experts (Mixtral)
    top_k: int = 0         # num_experts_per_tok
    moe_ffn: int = 0       # moe_intermediate_size (Mixtral: intermediate_size)
    shared_ffn: int = 0    # shared_expert_intermediate_size (Qwen2-MoE)
    shared_gate: bool = False   # Qwen2-MoE's sigmoid gate on the shared expert (1 x hidden)
    dense_layers: tuple[int, ...] = ()   # MoE models: the layers with a dense MLP of `ffn`

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def is_sparse(self, layer: int) -> bool:
        """Layer `layer` (0-based) has routed experts rather than a dense MLP."""
        return self.moe and layer not in self.dense_layers


def dense_layer_indices(layers: int, experts: int, sparse_step: int, mlp_only: list[int]) -> tuple[int, ...]:
    """The layers of an MoE model that keep a dense MLP: those transformers' rule for Qwen2-MoE
    and Qwen3-MoE (`formats.experts.sparse_layer_indices`) does not make sparse. A dense model
    has none (every layer is dense, none is listed)."""
    if not experts:
        return ()
    sparse = sparse_layer_indices(layers, sparse_step, mlp_only)
    return tuple(i for i in range(layers) if i not in sparse)


def _experts_from_hf(d: dict) -> dict:
    """The MoE facts of a config.json (Qwen2-MoE, Qwen3-MoE, Mixtral key names), {} for a dense model."""
    experts = d.get("num_experts") or d.get("num_local_experts") or 0
    if not experts:
        return {}
    shared = d.get("shared_expert_intermediate_size") or 0
    return {"experts": experts, "top_k": d["num_experts_per_tok"],
            "moe_ffn": d.get("moe_intermediate_size") or d["intermediate_size"],
            "shared_ffn": shared, "shared_gate": bool(shared),   # Qwen2-MoE gates its shared expert
            "dense_layers": dense_layer_indices(d["num_hidden_layers"], experts, d.get("decoder_sparse_step") or 1,
                                                d.get("mlp_only_layers") or [])}


def arch_from_hf(d: dict) -> Arch:
    heads = d["num_attention_heads"]
    name = (d.get("architectures") or [""])[0]
    return Arch(hidden=d["hidden_size"], layers=d["num_hidden_layers"], heads=heads,
                kv_heads=d.get("num_key_value_heads") or heads,
                head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                ffn=d["intermediate_size"], vocab=d["vocab_size"],
                max_positions=d.get("max_position_embeddings", 0),
                tied=bool(d.get("tie_word_embeddings", False)),
                qkv_bias=bool(d.get("attention_bias")) or "Qwen2" in name,
                qk_norm=name.startswith("Qwen3"), **_experts_from_hf(d))


def resolve_arch(cfg: RootConfig) -> tuple[Arch, str]:
    """model.arch from the recipe, else model.path/config.json."""
    f = cfg.model.arch
    if f.given:
        return Arch(f.hidden_size, f.num_layers, f.num_heads, f.num_kv_heads,
                    f.head_dim or f.hidden_size // f.num_heads, f.ffn_hidden_size, f.vocab_size,
                    f.max_position_embeddings, f.tie_embeddings, f.qkv_bias, f.qk_norm,
                    f.num_experts, f.moe_top_k, f.moe_ffn_hidden_size, f.shared_expert_ffn_hidden_size,
                    f.shared_expert_gate,
                    dense_layer_indices(f.num_layers, f.num_experts, f.moe_sparse_step, list(f.moe_dense_layers)),
                    ), "model.arch (recipe)"
    path = os.path.join(cfg.model.path, "config.json")
    try:
        with open(path) as fh:
            return arch_from_hf(json.load(fh)), path
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"model.arch is not set and {path} is not readable ({err.__class__.__name__}): "
                          f"give the architecture in the recipe (see recipes/models/*.yaml)") from None


def check_arch_matches(cfg: RootConfig, hf: dict) -> None:
    """A run whose recipe states model.arch: the facts `megarl plan` sized it with must be
    those of the checkpoint it loads (model.path/config.json), or the plan was for another
    model. Called by models/setup.build_all."""
    if not cfg.model.arch.given:
        return
    ours, theirs = asdict(resolve_arch(cfg)[0]), asdict(arch_from_hf(hf))
    if not hf.get("max_position_embeddings"):
        theirs["max_positions"] = ours["max_positions"]
    wrong = {k: (ours[k], theirs[k]) for k in ours if ours[k] != theirs[k]}
    if wrong:
        raise ConfigError(f"model.arch disagrees with {cfg.model.path}/config.json: "
                          + ", ".join(f"{k} {a} (recipe) != {b}" for k, (a, b) in wrong.items())
                          + ": fix recipes/models/*.yaml or model.path")
