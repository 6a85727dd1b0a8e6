"""The one module that touches megatron's parallel_state.

Everything else asks here for groups, ranks and stage positions, so a change of megatron's
API (or a move to explicit process-group collections) is a change in one file.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel


def initialize(tp: int, pp: int, seed: int, ep: int = 1) -> None:
    """Build the TP x PP x DP groups (world order: TP fastest, then DP, then PP) and seed the
    per-TP-rank RNG streams megatron uses for weight init and dropout. ep > 1: the expert
    groups too, each `ep` consecutive DP ranks splitting an MoE layer's experts (expert TP =
    tp); megatron keeps every expert's own data-parallel group for its gradients."""
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def tp_group():
    return ps.get_tensor_model_parallel_group()


def pp_group():
    return ps.get_pipeline_model_parallel_group()


def dp_group():
    return ps.get_data_parallel_group()


def tp_dp_group():
    """The TP x DP ranks of this pipeline stage (MoE router metrics reduce over them)."""
    return ps.get_tensor_and_data_parallel_group()


def tp_rank() -> int:
    return ps.get_tensor_model_parallel_rank()


def tp_size() -> int:
    return ps.get_tensor_model_parallel_world_size()


def pp_rank() -> int:
    return ps.get_pipeline_model_parallel_rank()


def pp_size() -> int:
    return ps.get_pipeline_model_parallel_world_size()


def ep_group():
    return ps.get_expert_model_parallel_group()


def ep_rank() -> int:
    return ps.get_expert_model_parallel_rank()


def ep_size() -> int:
    return ps.get_expert_model_parallel_world_size()


def edp_rank() -> int:
    """This rank's index among the ranks holding the same experts (expert data parallelism)."""
    return ps.get_expert_data_parallel_rank()


def dp_rank() -> int:
    return ps.get_data_parallel_rank()


def dp_size() -> int:
    return ps.get_data_parallel_world_size()


def layout() -> tuple:
    """(TP, PP, EP, DP) sizes, () before `initialize` (one process without groups)."""
    if not ps.model_parallel_is_initialized():
        return ()
    return tp_size(), pp_size(), ep_size(), dp_size()


def dp_rows(n: int) -> slice:
    """This DP rank's share of `n` rows: the r-th of dp_size() equal consecutive slices
    (n // dp_size() rows each; the caller makes n divisible)."""
    share = n // dp_size()
    return slice(dp_rank() * share, (dp_rank() + 1) * share)


def is_first_stage() -> bool:
    return ps.is_pipeline_first_stage()


def is_last_stage() -> bool:
    return ps.is_pipeline_last_stage()


def last_stage_global_rank() -> int:
    return ps.get_pipeline_model_parallel_last_rank()


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """In-place SUM over `group` (default: the whole world)."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t
