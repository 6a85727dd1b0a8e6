"""Mixture-of-Experts facts of an HF config, as the mapping tables and the trainer read them.

Pure: no torch. Qwen3-MoE and Qwen2-MoE decide per layer between a dense MLP and an MoE block
the same way (transformers' decoder layers): layer i is MoE unless it is in `mlp_only_layers`,
and only every `decoder_sparse_step`-th layer is ((i + 1) % step == 0).
"""
from __future__ import annotations

MOE_ARCHS = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
# config.json options megarl reproduces for each MoE family; any other MoE option set to a value
# other than its default is refused (`check_moe_options`) rather than silently ignored
_DEFAULTS_REFUSED = {
    # option: (value that is supported, why another is not)
    "moe_layer_freq": (None, "megarl reads mlp_only_layers / decoder_sparse_step"),
    "n_group": (None, "grouped top-k routing (DeepSeek-V3) is not mapped"),
    "topk_group": (None, "grouped top-k routing (DeepSeek-V3) is not mapped"),
    "routed_scaling_factor": (None, "a scaled router output is not mapped"),
    "first_k_dense_replace": (None, "megarl reads mlp_only_layers"),
}


def num_experts(hf_config) -> int:
    """Routed experts per MoE layer (`num_experts`; transformers 5 also names it
    `num_local_experts`); 0 for a dense model."""
    return int(getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None) or 0)


def sparse_layer_indices(layers: int, sparse_step: int | None, mlp_only) -> frozenset[int]:
    """The layers of an MoE model that hold an MoE block, by transformers' rule (module docstring):
    the one home of the rule (the plan's `models.arch.Arch` reads it too)."""
    step = max(1, int(sparse_step or 1))
    dense = set(mlp_only or ())
    return frozenset(i for i in range(layers) if i not in dense and (i + 1) % step == 0)


def moe_layers(hf_config) -> frozenset[int]:
    """The global indices of the layers that hold an MoE block (empty for a dense model)."""
    if not num_experts(hf_config):
        return frozenset()
    return sparse_layer_indices(hf_config.num_hidden_layers, getattr(hf_config, "decoder_sparse_step", 1),
                                getattr(hf_config, "mlp_only_layers", None))


def check_moe_options(hf_config, arch: str) -> None:
    """Raise naming the config.json option an MoE checkpoint sets that megarl does not reproduce."""
    if arch not in MOE_ARCHS:
        return
    if not num_experts(hf_config):
        raise ValueError(f"{arch} config.json has no num_experts: an MoE checkpoint names its routed "
                         f"experts per layer")
    k = int(getattr(hf_config, "num_experts_per_tok", 0) or 0)
    if not 1 <= k <= num_experts(hf_config):
        raise ValueError(f"{arch} config.json num_experts_per_tok={k} must lie in 1..num_experts="
                         f"{num_experts(hf_config)}")
    for option, (supported, why) in _DEFAULTS_REFUSED.items():
        value = getattr(hf_config, option, supported)
        if value != supported:
            raise ValueError(f"{arch} with {option}={value!r} in config.json is not supported: {why}")
    bad = [i for i in (getattr(hf_config, "mlp_only_layers", None) or [])
           if not 0 <= i < hf_config.num_hidden_layers]
    if bad:
        raise ValueError(f"{arch} config.json mlp_only_layers={bad} names layers the model lacks "
                         f"(num_hidden_layers={hf_config.num_hidden_layers})")
