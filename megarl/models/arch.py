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


def arch_from_hf(d: dict) -> Arch:
    heads = d["num_attention_heads"]
    return Arch(hidden=d["hidden_size"], layers=d["num_hidden_layers"], heads=heads,
                kv_heads=d.get("num_key_value_heads") or heads,
                head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                ffn=d["intermediate_size"], vocab=d["vocab_size"],
                max_positions=d.get("max_position_embeddings", 0),
                tied=bool(d.get("tie_word_embeddings", False)),
                qkv_bias="Qwen2" in (d.get("architectures") or [""])[0])


def resolve_arch(cfg: RootConfig) -> tuple[Arch, str]:
    """model.arch from the recipe, else model.path/config.json."""
    f = cfg.model.arch
    if f.given:
        return Arch(f.hidden_size, f.num_layers, f.num_heads, f.num_kv_heads,
                    f.head_dim or f.hidden_size // f.num_heads, f.ffn_hidden_size, f.vocab_size,
                    f.max_position_embeddings, f.tie_embeddings, f.qkv_bias), "model.arch (recipe)"
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
