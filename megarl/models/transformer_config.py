"""Translate a HuggingFace decoder config into megatron-core's TransformerConfig."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM")
# architectures whose attention normalises each head's query and key (RMSNorm) before RoPE
QK_NORM = ("Qwen3ForCausalLM",)


def architecture(hf_config) -> str:
    arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
    if arch not in SUPPORTED:
        raise ValueError(f"model architecture {arch!r} is not supported: megarl maps {list(SUPPORTED)}")
    return arch


def transformer_config(hf_config, tp: int, pp: int, dtype: torch.dtype, on_gpu: bool,
                       recompute: str = "none", sequence_parallel: bool = False) -> TransformerConfig:
    """A TransformerConfig reproducing the HF model's forward (RMSNorm, SwiGLU, RoPE, GQA).

    Dropout is off: RL recomputes logprobs that must match the engine's, and dropout would
    make the trainer's policy differ from the one that sampled.
    """
    arch = architecture(hf_config)
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if hf_config.num_hidden_layers % pp:
        raise ValueError(f"parallel.pp={pp} must divide the model's {hf_config.num_hidden_layers} layers")
    if kv_heads % tp:
        raise ValueError(f"parallel.tp={tp} must divide the model's {kv_heads} KV heads "
                         f"(QKV is split by whole GQA groups)")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    if sequence_parallel and not on_gpu:
        raise ValueError("parallel.sequence_parallel=true needs a GPU with Transformer Engine: megatron's "
                         "CPU (torch) LayerNorm path does not support it; set it to false on CPU")
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch == "Qwen2ForCausalLM",
        qk_layernorm=arch in QK_NORM,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        # micro-batches have shapes of their own (ppo/microbatch.py): each p2p message between
        # pipeline stages is preceded by its shape
        variable_seq_lengths=pp > 1,
        # megatron refuses variable_seq_lengths with its default MoE token dispatcher
        # (allgather) even in a dense model; these have no experts, no dispatcher is built
        moe_token_dispatcher_type="alltoall",
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not on_gpu,
        # fusions need Apex/TE kernels; on CPU the unfused paths are the only ones
        bias_activation_fusion=on_gpu,
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=on_gpu,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # "full": keep only each layer's input and recompute its activations in backward
        recompute_granularity="full" if recompute == "full" else None,
        recompute_method="uniform" if recompute == "full" else None,
        recompute_num_layers=1 if recompute == "full" else None,
    )
