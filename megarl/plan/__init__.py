"""`megarl plan RECIPE`: where every model goes on the recipe's cluster and whether it fits.

Placement follows the code: trainer ranks (TP x PP x DP) each hold actor, reference, critic
(PPO) and reward model (reward.model_path) for their stage and TP rank; the vLLM engines are
their own GPU pool (cluster.engine_nodes), rollout.engines.count of rollout.engines.tp GPUs.
train.offload_idle keeps reference, critic weights+gradients and reward model in host memory
except in the phases that use them (models/offload.py; the critic's Adam state stays).
weight_sync.transport=collective adds the weight transfer's packed GPU buffers on the sending
trainer GPU (global rank 0: PP stage 0) and on every engine GPU. The memory formulas are in
`megarl/plan/memory.py`; docs/plan.md compares them with published figures.

Modules: `placement` (make_plan), `trainer`, `engine` and `transfer` (each one's share of a
GPU), `inputs` (reward model, cluster), `report` (the printed plan), `lora` (LoRA adapters'
sizes: model.lora); the architecture facts come from `megarl.models.arch`.
"""
from __future__ import annotations

from megarl.models.arch import Arch, arch_from_hf, resolve_arch
from megarl.plan.engine import engine_memory
from megarl.plan.inputs import resolve_cluster, reward_arch
from megarl.plan.placement import ASSUMPTIONS, check_placeable, make_plan, per_gpu_bytes
from megarl.plan.report import format_plan, problems_message
from megarl.plan.trainer import Layout, best_layout, candidate_layouts, check_layout, trainer_fixes, trainer_memory
from megarl.plan.transfer import staging_note, transfer_buffers, transfer_formula

__all__ = ["ASSUMPTIONS", "Arch", "Layout", "arch_from_hf", "best_layout", "candidate_layouts", "check_layout",
           "check_placeable", "engine_memory", "format_plan", "make_plan", "per_gpu_bytes", "problems_message",
           "resolve_arch", "resolve_cluster", "reward_arch", "staging_note", "trainer_fixes", "trainer_memory",
           "transfer_buffers", "transfer_formula"]
