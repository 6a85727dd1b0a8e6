"""Gradient-alignment control of the actor's updates (algo.grad_align; docs/stabilizers.md).

Xu et al. (GAC, arXiv 2603.01501) find that under asynchronous training consecutive policy
gradients stay strongly aligned (high cosine similarity), where synchronous training gives
near-orthogonal ones, and that this amplifies correlated updates into instability; their remedy
projects the gradient to limit progress along the stale-aligned direction. Here, after each
actor backward pass and the DP reduction, before clipping and the optimizer:
  cos = <g, g_prev> / (|g| |g_prev|), logged as grad_cosine (algo.grad_align=log or project);
  project: when cos > algo.grad_align_threshold, g -= coef * g_prev with the coefficient that
  brings the cosine down to the threshold (ppo/stabilizers.py `alignment`, which says why).
g_prev is the previous update's raw gradient (before its own correction): the signal is how
the data's gradients line up, not how the corrected ones do.

The gradient is never gathered: every rank takes the dot products over the gradient it holds
(the distributed optimizer's fp32 shard; tensor-parallel duplicates and shared embeddings
counted once, as megatron's gradient norm counts them) and one all-reduce of three numbers over
megatron's gradient-statistics group (the whole world with the distributed optimizer) gives
the global values; every rank then applies the same coefficient to its shard. So the result
does not depend on TP, PP or DP (tests/dist/test_layouts.py).

Not in the checkpoint: g_prev is a full gradient copy; a resumed run's first update has no
previous gradient (no cosine, no correction), every later one is as in an uninterrupted run.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.ppo.stabilizers import alignment


class GradAlign:
    """The previous update's gradient and the per-step record of the cosines."""

    def __init__(self, threshold: float, project: bool):
        self.threshold, self.project = threshold, project
        self.prev: list[torch.Tensor] | None = None
        self._cosines: list[float] = []
        self._corrected = 0

    def step(self, optimizer) -> tuple[float, dict]:
        """megatron's optimizer step (prepare the main gradients, norm and clip, step) with the
        alignment measured and, in project mode, corrected between preparing and clipping.
        Returns (gradient norm after the correction, {"grad_cosine", "grad_align_coef"} or {})."""
        subs = list(getattr(optimizer, "chained_optimizers", [optimizer]))
        if optimizer.prepare_grads():   # fp16 loss-scale overflow only: megatron skips the step
            return 0.0, {}
        params = [(sub, p) for sub in subs for p in sub.get_parameters() if p.grad is not None]
        grads = [p.grad for _, p in params]
        raw = [g.detach().clone() for g in grads]   # the next update's g_prev, before any correction
        stats = {}
        if self.prev is not None:
            device = grads[0].device if grads else torch.device("cpu")
            sums = torch.zeros(3, dtype=torch.float64, device=device)
            for (sub, p), g, q in zip(params, grads, self.prev, strict=True):
                if _counted(sub, p):
                    g64, q64 = g.double(), q.double()
                    sums += torch.stack([(g64 * q64).sum(), (g64 * g64).sum(), (q64 * q64).sum()])
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(sums, group=optimizer.get_grad_stats_parallel_group())
            dot, g_sq, p_sq = sums.cpu().tolist()
            cos, coef = alignment(dot, g_sq, p_sq, self.threshold)
            stats = {"grad_cosine": cos, "grad_align_coef": coef if self.project else 0.0}
            self._cosines.append(cos)
            if self.project and coef:
                self._corrected += 1
                for g, q in zip(grads, self.prev, strict=True):
                    g.sub_(q.to(g.dtype), alpha=coef)
        self.prev = raw
        grad_norm = optimizer.get_grad_norm()
        _clip(subs, grad_norm)
        optimizer.step_with_ready_grads()
        return grad_norm, stats

    def take(self) -> dict:
        """The step's metrics (the same on every rank): grad_cosine, the mean cosine of the
        step's updates with their predecessors, and grad_align_corrected_frac, the fraction
        of them the projection changed; {} when no update had a predecessor yet."""
        if not self._cosines:
            return {}
        out = {"grad_cosine": sum(self._cosines) / len(self._cosines),
               "grad_align_corrected_frac": self._corrected / len(self._cosines)}
        self._cosines, self._corrected = [], 0
        return out


def _clip(subs, grad_norm: float) -> None:
    """megatron's gradient clipping by the global norm, as its optimizer step does it."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for sub in subs:
        params = sub.get_parameters()
        if getattr(sub, "is_stub_optimizer", False) or not params or sub.config.clip_grad <= 0:
            continue
        clip_grad_by_total_norm_fp32(params, max_norm=sub.config.clip_grad, total_norm=grad_norm,
                                     use_decoupled_grad=sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)


def _counted(sub, param) -> bool:
    """Whether megatron's gradient norm counts this main parameter on this rank: not a shared
    (tied) copy, not a tensor-parallel duplicate (LayerNorm weights live on every TP rank)."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.module import param_is_not_shared

    return param_is_not_shared(param) and \
        tensor_parallel.param_is_not_tensor_parallel_duplicate(param, getattr(sub, "tp_group", None))
