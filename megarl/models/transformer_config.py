"""Translate a HuggingFace decoder config into megatron-core's TransformerConfig."""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from megarl.formats import experts as moe

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM",
             *moe.MOE_ARCHS)
# architectures whose attention normalises each head's query and key (RMSNorm) before RoPE
QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
QKV_BIAS = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")


def softmax_kernels() -> bool:
    """Whether the fused masked-softmax CUDA extensions megatron's FusedScaleMaskSoftmax imports
    (Apex's / megatron's legacy fused kernels) are installed."""
    return all(importlib.util.find_spec(m) is not None
               for m in ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"))


def architecture(hf_config) -> str:
    arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
    if arch not in SUPPORTED:
        raise ValueError(f"model architecture {arch!r} is not supported: megarl maps {list(SUPPORTED)}")
    return arch


def moe_settings(hf_config, arch: str, ep: int, dispatcher: str, variable_lengths: bool,
                 aux_loss_coeff: float = 0.0, load_balancing: str = "aux_loss",
                 z_loss_coeff: float = 0.0, routing_replay: str = "off") -> dict:
    """The TransformerConfig fields of an MoE checkpoint's blocks ({} for a dense model).

    The router: softmax over every expert's logit, the top-k kept; with norm_topk_prob the k
    weights are renormalised, which is megatron's softmax over the top-k logits
    (moe_router_pre_softmax=False), else they stay the full softmax's (pre_softmax=True).
    Experts are SequentialMLP (moe_grouped_gemm off): the parameter names of the mapping
    table on CPU and GPU alike. routing_replay (algo.routing_replay) other than off gives each
    router megatron's RouterReplay (ppo/routing_replay.py drives it).
    """
    if arch not in moe.MOE_ARCHS:
        if routing_replay != "off":
            raise ValueError(f"algo.routing_replay={routing_replay} replays a Mixture-of-Experts model's expert "
                             f"choices, and {arch} has no experts: set algo.routing_replay=off")
        return {}
    moe.check_moe_options(hf_config, arch)
    n = moe.num_experts(hf_config)
    if n % ep:
        raise ValueError(f"parallel.ep={ep} must divide the model's {n} experts (num_experts in "
                         f"config.json): pick an expert-parallel size that divides {n}")
    if dispatcher == "allgather" and (variable_lengths or ep > 1):
        # megatron's allgather dispatcher gathers equal token counts from every EP rank, and
        # megarl's micro-batches are padded to their own longest sequence, rank by rank
        raise ValueError(f"parallel.moe_dispatcher=allgather needs micro-batches of one shape on every "
                         f"rank (parallel.ep={ep}, parallel.pp={'>1' if variable_lengths else 1}): "
                         f"use parallel.moe_dispatcher=alltoall, or allgather with ep=1 and pp=1")
    layers = moe.moe_layers(hf_config)
    out = dict(
        num_moe_experts=n, moe_router_topk=int(hf_config.num_experts_per_tok),
        moe_ffn_hidden_size=int(hf_config.moe_intermediate_size),
        moe_layer_freq=[int(i in layers) for i in range(hf_config.num_hidden_layers)],
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not bool(getattr(hf_config, "norm_topk_prob", False)),
        moe_grouped_gemm=False, moe_permute_fusion=False, moe_token_dispatcher_type=dispatcher,
        expert_model_parallel_size=ep,
        moe_router_load_balancing_type=load_balancing if aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=aux_loss_coeff, moe_z_loss_coeff=z_loss_coeff or None,
        moe_enable_routing_replay=routing_replay != "off",
    )
    shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)
    if arch == "Qwen2MoeForCausalLM" and shared:
        out.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    return out


def transformer_config(hf_config, tp: int, pp: int, dtype: torch.dtype, on_gpu: bool,
                       recompute: str = "none", sequence_parallel: bool = False, ep: int = 1,
                       dispatcher: str = "alltoall", router: dict | None = None) -> TransformerConfig:
    """A TransformerConfig reproducing the HF model's forward (RMSNorm, SwiGLU, RoPE, GQA; QK
    norms; MoE blocks with `ep` expert-parallel ranks and the `dispatcher`).

    Dropout is off: RL recomputes logprobs that must match the engine's, and dropout would
    make the trainer's policy differ from the one that sampled. router: aux_loss_coeff,
    load_balancing, z_loss_coeff (moe_settings; default: no router loss).
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
        add_qkv_bias=arch in QKV_BIAS,
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
        # (allgather) even in a dense model, which builds no dispatcher
        **{"moe_token_dispatcher_type": "alltoall",
           **moe_settings(hf_config, arch, ep, dispatcher, pp > 1, **(router or {}))},
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not on_gpu,
        # fusions need Apex/TE kernels; on CPU the unfused paths are the only ones
        bias_activation_fusion=on_gpu,
        bias_dropout_fusion=on_gpu,
        # the local spec's attention (no TE: a LoRA run's, models/builders.py) fuses its softmax
        # with compiled kernels megatron-core's wheel does not ship: asked for only where present
        masked_softmax_fusion=on_gpu and softmax_kernels(),
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # "full": keep only each layer's input and recompute its activations in backward
        recompute_granularity="full" if recompute == "full" else None,
        recompute_method="uniform" if recompute == "full" else None,
        recompute_num_layers=1 if recompute == "full" else None,
    )
