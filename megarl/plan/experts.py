"""Mixture-of-Experts terms of a plan: pure arithmetic on the architecture facts and the
trainer's expert layout, used by `memory` (parameters, activations) and the simulator (FLOPs).

How megatron-core lays experts out (`parallel_state.initialize_model_parallel`): the ranks of
one pipeline stage, TP x DP of them, are regrouped for the experts as ETP x EP x EDP (expert
tensor parallel, expert parallel, expert data parallel), so EDP = TP x DP / (ETP x EP). Each
EP rank holds experts / EP whole experts of every MoE layer, each split over ETP. What is not
an expert (attention, norms, the router, a shared expert, embedding and head) is laid out as in
a dense model: split over TP, replicated over DP.

Its distributed optimizer keeps two sets of buffers (`DistributedDataParallel`:
`buffers` over the DP group, `expert_parallel_buffers` over the expert-DP group;
`optimizer.get_megatron_optimizer` builds one optimizer on each): the fp32 gradient buffer
covers every local parameter unsharded, and Adam's state (with the fp32 main weights of a
bf16 model) is sharded over DP for the dense parameters and over EDP for the experts. Per GPU
the experts' optimizer state is 12 x expert params / (ETP x EP x EDP) = 12 x expert params of
the stage / (TP x DP): every rank of the stage holds an equal slice whatever EP is; EP only
moves expert weights and gradients off a GPU.

Activations assume balanced routing (megatron's dropless default routes every token, so a
skewed router puts more tokens on one rank than counted here: the reserve must cover it) and
megatron's alltoall dispatcher: a rank routes its tokens (s x b / TP: megatron trains MoE with
TP > 1 only under sequence parallelism), each to top-k experts, and after the all-to-all and
the all-gather over ETP holds top-k x ETP x its tokens routed copies.
"""
from __future__ import annotations

from megarl.models.arch import Arch


def expert_data_parallel(tp: int, dp: int, ep: int, etp: int) -> int:
    """EDP, the group the experts' optimizer state is sharded over: TP x DP / (ETP x EP)."""
    return tp * dp // (etp * ep)


def router_params(a: Arch) -> int:
    """The router of one MoE layer: experts x hidden, replicated over TP (a dense parameter)."""
    return a.experts * a.hidden


def expert_params(a: Arch) -> int:
    """One routed expert's SwiGLU: gate, up and down projections."""
    return 3 * a.hidden * a.moe_ffn


def sparse_mlp_params(a: Arch, tp: int = 1, ep: int = 1, etp: int = 1) -> tuple[float, float]:
    """(dense part, expert part) of one MoE layer's MLP on one GPU: the router (replicated)
    and the shared expert (its SwiGLU, 3 x hidden x shared_ffn, over TP; Qwen2-MoE's 1 x hidden
    gate replicated); experts / EP local experts, each over ETP."""
    shared = 3 * a.hidden * a.shared_ffn / tp + (a.hidden if a.shared_gate else 0)
    return router_params(a) + shared, a.experts / ep * expert_params(a) / etp


def routed_copies_per_token(a: Arch, tp: int, etp: int, sequence_parallel: bool) -> float:
    """Routed token copies a GPU computes per token of the micro-batch, at balance: its tokens
    (1/TP of them under sequence parallelism) x top-k, gathered over ETP."""
    return a.top_k * etp / (tp if sequence_parallel else 1)


def sparse_layer_activation_bytes(a: Arch, tp: int, etp: int, act_bytes: int, sequence_parallel: bool,
                                  fused: bool) -> float:
    """Bytes an MoE layer's MLP keeps for backward per token of the micro-batch (what replaces
    a dense layer's 3f/TP, or 5f/TP unfused):
    - router: its logits and probabilities over the experts, 2 x experts fp32 per routed token;
    - each routed copy: three hidden-wide tensors of the dispatch and the experts (the experts'
      input, their output and the combine's copy, 3h: measured on the CPU path with megatron's
      alltoall dispatcher, tests/dist/test_plan_moe_memory.py), the gate|up output (2f) and
      SwiGLU's output (f) at f = moe_ffn / ETP; the unfused local spec (SequentialMLP, the CPU
      path) keeps 5f as a dense SwiGLU does;
    - the shared expert, a dense SwiGLU over TP (3 or 5 x shared_ffn / TP)."""
    tokens = 1 / (tp if sequence_parallel else 1)
    f = a.moe_ffn / etp
    per_copy = 3 * a.hidden + (3 if fused else 5) * f
    routed = routed_copies_per_token(a, tp, etp, sequence_parallel) * per_copy * act_bytes
    shared = (3 if fused else 5) * a.shared_ffn / tp * act_bytes
    return tokens * 2 * a.experts * 4 + routed + shared


def dispatcher_bytes(a: Arch, seq: int, mbs: int, tp: int, etp: int, act_bytes: int,
                     sequence_parallel: bool) -> float:
    """The alltoall dispatcher's transient buffers for the one MoE layer in flight: the permuted
    tokens it sends and the ones it receives (then gathers over ETP), hidden wide each. Not kept
    for backward, so counted once per pass, not per layer."""
    return 2 * seq * mbs * routed_copies_per_token(a, tp, etp, sequence_parallel) * a.hidden * act_bytes


def sparse_mlp_workspace_width(a: Arch, engine_tp: int, expert_parallel: bool = False) -> float:
    """Values per token of vLLM's fused-MoE working caches on one engine GPU (gate|up and
    SwiGLU output of each routed copy over TP, the hidden-wide output of each copy) plus the
    shared expert's SwiGLU: what replaces a dense layer's 3 x ffn / TP in its workspace.
    With expert parallelism (rollout.engines.expert_parallel) a GPU holds whole experts: its
    caches are as many rows (tokens x top-k) at the experts' full width. The experts' weights
    per GPU are the same either way (all of them over TP, or 1/TP of them whole)."""
    split = 1 if expert_parallel else engine_tp
    return a.top_k * (3 * a.moe_ffn / split + a.hidden) + 3 * a.shared_ffn / engine_tp
