"""Build the trainer's models (actor, reference, critic) on megatron-core from an HF checkpoint.

Transformer Engine layer specs on GPU when TE imports, megatron's local spec otherwise (CPU).
The critic is the same backbone with a scalar value head in place of the LM head.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.transformer_config import TransformerConfig

from megarl.distributed import parallel
from megarl.formats.mapping import padded_vocab_size
from megarl.models.norms import sequence_parallel_spec

# LoRA wraps megatron's local tensor-parallel linear layers (models/lora.py `LoRALinear`), not
# Transformer Engine's fused layernorm + linear: a process whose models carry adapters builds the
# local spec on GPUs too, and every reader of `use_te` (the mapping tables' names, the loaders,
# the weight push, the exports) follows it, so the whole process agrees on one set of names.
_LOCAL_LAYERS = False


def local_layers(on: bool) -> None:
    """Build megatron's local layer spec even where TE is installed (`on`: model.lora.rank > 0).
    Set before any model is built: by the trainer at its start and by `setup.build_all`."""
    global _LOCAL_LAYERS
    _LOCAL_LAYERS = bool(on)


def use_te() -> bool:
    """TE specs need a GPU and the transformer_engine package (and no LoRA: `local_layers`)."""
    if _LOCAL_LAYERS or not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def layer_spec(config: TransformerConfig):
    """The decoder layer's spec: TE's on a GPU with TE, megatron's local one otherwise; the
    query / key norms where the config asks for them (Qwen3). An MoE model gets a block spec
    of its own, dense and MoE layers as config.moe_layer_freq says."""
    if config.num_moe_experts:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te(), normalization="RMSNorm",
                                          pp_rank=parallel.pp_rank())
    elif use_te():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
    # without TE, megatron's torch norms refuse sequence parallelism: models/norms.py
    return spec if use_te() else sequence_parallel_spec(spec, config, parallel.pp_rank())


def rope_parameters(hf_config) -> dict:
    """RoPE settings across transformers versions (`rope_parameters` in 5.x; `rope_theta` and
    `rope_scaling` attributes before)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000))
    params.update(getattr(hf_config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"rope_type {rope_type!r} is not supported: megarl maps default and llama3 RoPE")
    if rope_type == "llama3":
        # megatron-core applies llama3 scaling with only `factor` configurable; the rest is fixed
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        wrong = {k: params.get(k) for k, v in fixed.items() if float(params.get(k, v)) != v}
        if wrong:
            raise ValueError(f"rope_scaling {wrong} differs from the llama3 values megatron-core "
                             f"implements ({fixed}); such a checkpoint would not reproduce its HF logits")
    return params


class ValueHead(torch.nn.Module):
    """Scalar head standing where GPTModel calls its output layer.

    GPTModel calls `output_layer(hidden, weight=..., runtime_gather_output=...)` and expects
    `(output, bias)`; answering that call lets the critic reuse GPTModel's forward, PP stages
    and schedules unchanged. Hidden states are full (not TP-split) at this point, so the head
    is replicated over TP ranks; megatron reduces its gradients like any replicated parameter.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:  # hidden arrives split over the sequence: [s/tp, b, h]
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
            # every TP rank computes the whole head from the gathered sequence: backward keeps
            # its own slice of the gradient (summing the TP ranks' identical ones doubled it)
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return hidden @ self.weight.t(), None  # [s, b, 1]


@dataclass
class ModelInfo:
    """What the rest of megarl needs to know about a built model."""
    hf_config: object
    config: TransformerConfig
    vocab_size: int          # the tokenizer's vocab; logits beyond it are padding
    padded_vocab: int
    layer_offset: int        # first HF layer index held by this PP stage
    expert_offset: int = 0   # first global expert held by this EP rank (MoE)


def build_model(hf_config, config: TransformerConfig, divisible_by: int, role: str):
    """GPTModel for this PP stage. role: "actor" | "reference" | "critic"."""
    tp, pp = parallel.tp_size(), parallel.pp_size()
    vocab = hf_config.vocab_size
    padded = padded_vocab_size(vocab, divisible_by, tp)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False)) and role != "critic"
    rope = rope_parameters(hf_config)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config),
        vocab_size=padded,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=parallel.is_first_stage(),
        post_process=parallel.is_last_stage(),
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope",
        rotary_base=int(rope.get("rope_theta", 10000)),
        rope_scaling=rope.get("rope_type") == "llama3",
        rope_scaling_factor=float(rope.get("factor", 8.0)),
    )
    if role == "critic" and parallel.is_last_stage():
        model.output_layer = ValueHead(config.hidden_size, config.params_dtype, config.sequence_parallel)
    per_stage = hf_config.num_hidden_layers // pp
    local_experts = (config.num_moe_experts or 0) // parallel.ep_size()
    info = ModelInfo(hf_config, config, vocab, padded, parallel.pp_rank() * per_stage,
                     parallel.ep_rank() * local_experts)
    return model, info


@dataclass
class Trainable:
    """A model with its megatron DDP wrapper, optimizer and LR schedule."""
    model: DistributedDataParallel
    optimizer: object
    scheduler: OptimizerParamScheduler
    info: ModelInfo
    align: object = None    # the actor's gradient-alignment control (ppo/grad_align.py), made on first use
    # the LR schedule's advance per optimizer update (ppo/step.py sets it each step): 1 / k in a
    # step of k times train.groups_per_step (partial rollout's elastic steps), so the schedule
    # counts weight versions and spans train.steps whatever each step's size
    schedule_increment: float = 1.0


def make_trainable(model: GPTModel, info: ModelInfo, lr: float, weight_decay: float,
                   grad_clip: float, warmup: int, total_updates: int, decay_style: str = "constant",
                   min_lr_ratio: float = 0.1) -> Trainable:
    """Wrap in megatron DDP (grad buffers, DP reduce) and build the distributed optimizer."""
    from megatron.core.distributed import finalize_model_grads

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=True)
    ddp = DistributedDataParallel(config=info.config, ddp_config=ddp_config, module=model)
    cfg = info.config
    # megatron's schedules read these hooks off the model config
    cfg.no_sync_func = ddp.no_sync
    cfg.finalize_model_grads_func = finalize_model_grads
    min_lr = lr if decay_style == "constant" else lr * min_lr_ratio
    opt_cfg = OptimizerConfig(optimizer="adam", lr=lr, min_lr=min_lr, weight_decay=weight_decay,
                              clip_grad=grad_clip, use_distributed_optimizer=True,
                              bf16=cfg.bf16, params_dtype=cfg.params_dtype, adam_beta2=0.999)
    optimizer = get_megatron_optimizer(opt_cfg, [ddp])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else lr, max_lr=lr, min_lr=min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=max(total_updates, warmup + 1), lr_decay_style=decay_style,
        start_wd=weight_decay, end_wd=weight_decay, wd_incr_steps=max(total_updates, 1),
        wd_incr_style="constant")
    return Trainable(ddp, optimizer, scheduler, info)
