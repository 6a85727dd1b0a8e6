"""Memory per GPU of megarl's models: pure arithmetic on architecture facts and layout.

What is counted follows what the code builds (megarl/models/builders.py, setup.py,
offload.py), not a generic rule:
- a trainable model (actor, critic) is megatron DDP + distributed optimizer with
  `grad_reduce_in_fp32=True`: per parameter its weight (dtype bytes), an fp32 gradient buffer
  (4, not sharded), and Adam state sharded over DP: fp32 main weight + m + v (12) for a bf16
  model, m + v (8) for an fp32 one (its main weights are the model's own). ZeRO's mixed
  precision count (Rajbhandari et al. 2020, sec. 3.1) is 2 + 2 + 12 = 16 bytes/param; megarl's
  fp32 gradient buffer makes it 18. An MoE model's experts are split over EP (and ETP) and
  their Adam state is sharded over the expert-data-parallel group instead (plan/experts.py).
- frozen models (reference, reward model): their weights only. LoRA (model.lora): the actor's
  (and with model.lora.critic the critic's) base is frozen, its weights only, and its adapters
  hold what a trainable parameter holds (plan/lora.py); the reference is the actor itself.
- activations: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models", sec. 4.1) per layer, re-derived for what the models are (RMSNorm,
  SwiGLU, GQA, no dropout, flash attention on GPU), plus the logits on the last stage.
- engine: the bf16 weights over engine TP and the KV cache 2 x layers x kv_heads x head_dim x
  bytes per token (Kwon et al. 2023, vLLM).
- weight transfer (weight_sync.transport=collective over NCCL): the packed buffers in flight
  on the sending trainer GPU and on every engine GPU (vLLM's packed broadcast); over CUDA IPC
  (backend ipc) the whole model once more on the sending GPU, none on the engine's.
Bytes everywhere; GiB only when printed.
"""
from __future__ import annotations

import math

from megarl.models.arch import Arch  # the facts these formulas take
from megarl.plan import experts

GiB = 2 ** 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def gib(x: float) -> float:
    """Bytes as the GiB a plan prints (2 decimals)."""
    return round(x / GiB, 2)


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocab (= formats.mapping.padded_vocab_size, kept torch-free here)."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab / multiple) * multiple)


# -- parameters ------------------------------------------------------------------------------
def attention_params(a: Arch, tp: int = 1) -> float:
    """One layer's attention and norms on one TP rank: the four attention matrices (and the QKV
    bias) split over TP; the two RMSNorm weights and Qwen3's query/key norms (head_dim each,
    shared by the heads) replicated."""
    q = a.heads * a.head_dim
    kv = 2 * a.kv_heads * a.head_dim
    attn = a.hidden * (q + kv) + q * a.hidden + ((q + kv) if a.qkv_bias else 0)
    return attn / tp + 2 * a.hidden + (2 * a.head_dim if a.qk_norm else 0)


def layer_param_split(a: Arch, layer: int = 0, tp: int = 1, ep: int = 1, etp: int = 1) -> tuple[float, float]:
    """(dense, expert) parameters of layer `layer` on one GPU: a dense layer's SwiGLU is split
    over TP; an MoE layer's router, shared expert and local experts are `experts.sparse_mlp_params`.
    The two parts differ in how the optimizer shards them (`trainable_bytes_per_param`)."""
    attn = attention_params(a, tp)
    if a.is_sparse(layer):
        dense, local_experts = experts.sparse_mlp_params(a, tp, ep, etp)
        return attn + dense, local_experts
    return attn + 3 * a.hidden * a.ffn / tp, 0.0


def layer_params(a: Arch, tp: int = 1, layer: int = 0, ep: int = 1, etp: int = 1) -> float:
    """Parameters of one transformer layer held by one GPU (dense and expert parts)."""
    return sum(layer_param_split(a, layer, tp, ep, etp))


def total_params(a: Arch) -> int:
    """Parameters of the HF model (untied: embedding and LM head each vocab x hidden), every
    expert included: what the weights weigh in memory and on the wire."""
    emb = a.vocab * a.hidden * (1 if a.tied else 2)
    return int(sum(layer_params(a, layer=i) for i in range(a.layers)) + emb + a.hidden)


def active_params(a: Arch) -> int:
    """Parameters one token computes with: total_params less, in every MoE layer, the routed
    experts it is not sent to (experts - top_k of them). = total_params for a dense model. What
    FLOPs per token follow (2 x active forward, 6 x active forward + backward)."""
    idle = sum(a.experts - a.top_k for i in range(a.layers) if a.is_sparse(i))
    return total_params(a) - idle * experts.expert_params(a)


def stage_layers(a: Arch, pp: int, stage: int) -> range:
    """The layers megatron builds on pipeline stage `stage` (layers / PP each, in order)."""
    per = a.layers // pp
    return range(stage * per, (stage + 1) * per)


def stage_param_split(a: Arch, tp: int, pp: int, stage: int, role: str, divisible_by: int = 128,
                      ep: int = 1, etp: int = 1) -> tuple[float, float]:
    """(dense, expert) parameters of one GPU of PP stage `stage` of a built model. role: actor |
    reference | critic | reward. The first stage has the (padded, TP-split) embedding; the last
    the final norm and the output layer: the LM head for actor/reference (a second copy of the
    embedding when tied and pp > 1, as megatron keeps one), a 1 x hidden value head for
    critic/reward. Experts (EP x ETP) only in MoE layers."""
    v = padded_vocab(a.vocab, divisible_by, tp)
    dense = local_experts = 0.0
    for i in stage_layers(a, pp, stage):
        d, e = layer_param_split(a, i, tp, ep, etp)
        dense, local_experts = dense + d, local_experts + e
    if stage == 0:
        dense += v * a.hidden / tp
    if stage == pp - 1:
        dense += a.hidden  # final norm
        if role in ("critic", "reward"):
            dense += a.hidden
        elif not a.tied or pp > 1:
            dense += v * a.hidden / tp
    return dense, local_experts


def stage_params(a: Arch, tp: int, pp: int, stage: int, role: str, divisible_by: int = 128,
                 ep: int = 1, etp: int = 1) -> float:
    """All parameters of one GPU of a PP stage (`stage_param_split`, both parts)."""
    return sum(stage_param_split(a, tp, pp, stage, role, divisible_by, ep, etp))


def trainable_bytes_per_param(dtype: str, dp: int) -> dict[str, float]:
    """Bytes per parameter of a megatron DDP model with the distributed optimizer, as
    builders.make_trainable configures it (grad_reduce_in_fp32, use_distributed_optimizer)."""
    w = DTYPE_BYTES[dtype]
    opt = (4 + 8) if w == 2 else 8    # bf16: fp32 main copy + Adam m, v; fp32: m, v only
    return {"weights": w, "grads": 4, "optimizer": opt / dp}


# -- activations -----------------------------------------------------------------------------
def layer_activation_bytes(a: Arch, seq: int, mbs: int, tp: int, act_bytes: int = 2,
                           sequence_parallel: bool = False, fused: bool = True, layer: int = 0,
                           etp: int = 1) -> float:
    """Activations layer `layer` keeps for backward, per micro-batch (Korthikanti et al. 2022
    sec. 4.1, terms re-derived for RMSNorm + GQA + SwiGLU, no dropout).

    Korthikanti's GPT layer stores sbh(34 + 5as/h) bytes at 2 bytes per value: sbh x {4 for the
    two LayerNorm inputs, 2 + 2 for the inputs of QKV and of the MLP, 4 + 2 for Q, K, V,
    2 for the output projection's input, 8 + 8 for GeLU's input and output, 1 + 1 dropout
    masks} + 5as^2b for the scores (softmax output 2, its dropout mask 1 and output 2).
    Here, in units of act_bytes x s x b, on the GPU path (`fused`: Transformer Engine's fused
    RMSNorm + linear and flash attention, megatron's fused SwiGLU):
    - not split over TP (unless sequence parallel): the two norm inputs, the QKV input and
      the MLP input: 4h;
    - split over TP: Q (heads x head_dim) and K, V (kv_heads x head_dim each) after RoPE, the
      attention output that feeds the projection (h), SwiGLU's gate|up output (2f, the fused
      kernel recomputes the rest) and its output feeding the down projection (f): q + 2kv + h + 3f;
    - no dropout masks (dropout is off in every megarl model); no a x s x s scores (flash).
    With GeLU in place of SwiGLU (2f instead of 3f, f = 4h), MHA (q = kv = h) and the masks
    put back this is Korthikanti's sbh(10 + 24/t) (tests/unit/test_plan.py).
    `fused=False` is megatron's local spec (the CPU path, measured by bench/plan_check.py):
    each unfused RMSNorm also keeps its normalised value (+2h), K and V are expanded to every
    query head (2q instead of 2kv), the unfused SwiGLU keeps gate|up, the up copy, silu's
    output and the product (5f), and the softmax output (a x s per token) is kept.
    Qwen3's query/key norms (over TP with their heads) keep their inputs, q + kv, fused; the
    unfused norms 3 x (q + kv) and a statistic per head, measured on the CPU path
    (tests/dist/test_plan_moe_memory.py).
    An MoE layer's MLP term (3f or 5f) is `experts.sparse_layer_activation_bytes` instead:
    router, routed copies (over ETP), shared expert."""
    q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    mlp = 0 if a.is_sparse(layer) else a.ffn
    if fused:
        replicated, split = 4 * a.hidden, q + 2 * kv + a.hidden + 3 * mlp + (q + kv if a.qk_norm else 0)
    else:
        qk = 3 * (q + kv) + a.heads + a.kv_heads if a.qk_norm else 0
        replicated, split = 6 * a.hidden, 3 * q + a.hidden + 5 * mlp + a.heads * seq + qk
    per_token = replicated / (tp if sequence_parallel else 1) + split / tp
    out = act_bytes * seq * mbs * per_token
    if a.is_sparse(layer):
        out += seq * mbs * experts.sparse_layer_activation_bytes(a, tp, etp, act_bytes, sequence_parallel, fused)
    return out


def layer_input_bytes(a: Arch, seq: int, mbs: int, tp: int, act_bytes: int = 2,
                      sequence_parallel: bool = False) -> float:
    """What full recomputation keeps per layer: its input, 2sbh (Korthikanti et al. 2022), split
    over TP only with sequence parallelism."""
    return act_bytes * seq * mbs * a.hidden / (tp if sequence_parallel else 1)


def head_bytes(a: Arch, seq: int, mbs: int, tp: int, act_bytes: int = 2, divisible_by: int = 128,
               fused: bool = True, logits: bool = True) -> float:
    """The last stage's output for one micro-batch, kept for backward: the final RMSNorm (its
    input and the output layer's input; + the normalised value unfused) and, with an LM head,
    the three fp32 copies of this TP rank's vocab slice models/logprobs.py keeps (shifted
    logits, exp, probabilities for the entropy). The critic's value head output is negligible."""
    out = act_bytes * seq * mbs * a.hidden * (2 if fused else 3)
    if logits:
        out += seq * mbs * padded_vocab(a.vocab, divisible_by, tp) / tp * 4 * 3
    return out


def in_flight_microbatches(pp: int, stage: int, microbatches: int) -> int:
    """1F1B keeps pp - stage micro-batches' activations on a stage at its peak (Narayanan et
    al. 2021); never more than there are micro-batches. pp = 1: one at a time."""
    return max(1, min(pp - stage, microbatches))


def stage_activation_bytes(a: Arch, seq: int, mbs: int, tp: int, pp: int, stage: int, microbatches: int,
                           act_bytes: int = 2, sequence_parallel: bool = False, fused: bool = True,
                           recompute: str = "none", with_logits: bool = True,
                           divisible_by: int = 128, etp: int = 1) -> float:
    """Peak activations of one stage in a training pass. Without recomputation every layer
    of every in-flight micro-batch keeps its activations; with `full` only each layer's input
    is kept, plus one layer's full set (the largest) while it is recomputed in backward. The
    last stage (one micro-batch in flight) adds its head; a stage with MoE layers the
    dispatcher's buffers of the layer in flight."""
    layers = stage_layers(a, pp, stage)
    k = in_flight_microbatches(pp, stage, microbatches)
    each = [layer_activation_bytes(a, seq, mbs, tp, act_bytes, sequence_parallel, fused, i, etp) for i in layers]
    if recompute == "full":
        kept = k * len(layers) * layer_input_bytes(a, seq, mbs, tp, act_bytes, sequence_parallel) + max(each)
    else:
        kept = k * sum(each)
    kept += stage_dispatcher_bytes(a, seq, mbs, tp, pp, stage, act_bytes, sequence_parallel, etp)
    if stage == pp - 1:
        kept += head_bytes(a, seq, mbs, tp, act_bytes, divisible_by, fused, with_logits)
    return kept


def stage_dispatcher_bytes(a: Arch, seq: int, mbs: int, tp: int, pp: int, stage: int, act_bytes: int = 2,
                           sequence_parallel: bool = False, etp: int = 1) -> float:
    """The MoE dispatcher's transient buffers (`experts.dispatcher_bytes`) on a stage with an MoE layer."""
    if not any(a.is_sparse(i) for i in stage_layers(a, pp, stage)):
        return 0.0
    return experts.dispatcher_bytes(a, seq, mbs, tp, etp, act_bytes, sequence_parallel)


def forward_only_bytes(a: Arch, seq: int, mbs: int, tp: int, pp: int, stage: int, act_bytes: int = 2,
                       sequence_parallel: bool = False, fused: bool = True, with_logits: bool = True,
                       divisible_by: int = 128, etp: int = 1) -> float:
    """A forward-only pass (old/reference logprobs, values, reward) frees each layer's
    activations as it goes: the largest layer's set (+ the dispatcher's buffers), and the
    head on the last stage."""
    out = max(layer_activation_bytes(a, seq, mbs, tp, act_bytes, sequence_parallel, fused, i, etp)
              for i in stage_layers(a, pp, stage))
    out += stage_dispatcher_bytes(a, seq, mbs, tp, pp, stage, act_bytes, sequence_parallel, etp)
    if stage == pp - 1:
        out += head_bytes(a, seq, mbs, tp, act_bytes, divisible_by, fused, with_logits)
    return out


# -- engines ---------------------------------------------------------------------------------
def kv_bytes_per_token(a: Arch, engine_tp: int, kv_bytes: int = 2) -> float:
    """One token's KV cache on one GPU of an engine: 2 (K and V) x layers x kv_heads x head_dim
    x bytes, the kv heads split over TP; vLLM replicates them when TP exceeds them."""
    heads_per_gpu = max(a.kv_heads / engine_tp, 1)
    return 2 * a.layers * heads_per_gpu * a.head_dim * kv_bytes


def engine_weight_bytes(a: Arch, engine_tp: int, w_bytes: int = 2) -> float:
    """An engine GPU's share of the bf16 weights (vLLM pads the vocab only to 64: ignored)."""
    return total_params(a) * w_bytes / engine_tp


def engine_workspace_bytes(a: Arch, engine_tp: int, seqs: int, batched_tokens: int = 8192,
                           expert_parallel: bool = False) -> float:
    """vLLM's non-KV working memory, approximately: fp32 logits of the running batch over the
    full vocab (sampling), and one prefill chunk's activations (hidden, q/kv, gate/up) at
    bf16. vLLM measures it in a profiling run; this is the same order of magnitude. An MoE
    model's MLP is the wider of its dense layers' and its fused-MoE caches
    (`experts.sparse_mlp_workspace_width`)."""
    logits = seqs * a.vocab * 4
    dense = 3 * a.ffn / engine_tp if len(a.dense_layers) or not a.moe else 0
    mlp = max(dense, experts.sparse_mlp_workspace_width(a, engine_tp, expert_parallel) if a.moe else 0)
    act = batched_tokens * 2 * 2 * (a.hidden + (a.heads + 2 * a.kv_heads) * a.head_dim / engine_tp + mlp)
    return logits + act


# -- weight transfer -------------------------------------------------------------------------
MiB = 2 ** 20


def largest_hf_tensor(a: Arch) -> int:
    """Elements of the largest tensor a weight sync sends: the sync sends full HF tensors (TP
    gathered), so the embedding or LM head (vocab x hidden), else an MLP (ffn x hidden) or
    the query/output projection (heads x head_dim x hidden). An MoE model sends each expert's
    projections apart (moe_ffn x hidden), the router (experts x hidden) and a shared expert's;
    its dense ffn only where a layer has a dense MLP (Qwen3-MoE's config.json states one for
    none)."""
    dense_ffn = a.ffn if not a.moe or a.dense_layers else 0
    return max(a.vocab, dense_ffn, a.heads * a.head_dim, a.moe_ffn, a.experts, a.shared_ffn) * a.hidden


def transfer_buffer_bytes(a: Arch, bucket_mb: int, num_buffers: int, w_bytes: int) -> float:
    """GPU bytes of the collective weight transfer's packed buffers on ONE side: the sending
    trainer GPU, or any one engine GPU (every engine worker receives every tensor whole into
    buffers of its own, whatever the engine TP; it keeps its shard when loading).

    A buffer holds whole tensors. vLLM's packed broadcast
    (`vllm/distributed/weight_transfer/packed_tensor.py`) closes one after the tensor that
    takes it past `bucket_mb`, so it is at most bucket_mb MiB + the largest tensor; megarl's
    sender (`rollout.weights.source.buckets`) closes one before, so an oversize tensor travels
    alone: max(bucket, largest). The bound here covers both. `num_buffers` are in flight.
    w_bytes: bytes per element as sent (the trainer's model.dtype).
    `megarl plan` counts them in every phase, a safe bound: an engine's receive buffers stay
    reserved between syncs (vLLM allocates them on its own cached CUDA streams, and PyTorch's
    caching allocator keeps a freed block for the stream it was allocated on); the trainer's
    are packed on the default stream, where the next phase may reuse the freed blocks if
    fragmentation allows."""
    return num_buffers * (bucket_mb * MiB + largest_hf_tensor(a) * w_bytes)


def ipc_sender_bytes(a: Arch, bucket_mb: int, num_buffers: int, w_bytes: int) -> float:
    """GPU bytes on the sending trainer GPU with weight_sync.backend=ipc: the engines read each
    packed bucket in place (CUDA IPC) and vLLM's layerwise reload keeps views of them until the
    update's finish, so every bucket of a push stays alive until then: the whole model once
    more (as vLLM's own ipc trainer holds it), plus the reused buffers of `transfer_buffer_bytes`
    (a bucket packed into one may not fill it). The engine side holds nothing of its own."""
    return total_params(a) * w_bytes + transfer_buffer_bytes(a, bucket_mb, num_buffers, w_bytes)
