"""NaN/Inf guards: found before an optimizer step, named, and never written into the weights.

Every check is a collective decision: each rank computes a local flag and one all-reduce
(MAX) over all trainer ranks makes every rank agree, so ranks never diverge on whether a
step updates. What a non-finite value then does is `train.on_nonfinite`: `stop` raises
`NonFiniteError` naming the quantity and the step (the run ends; the newest checkpoint is
the last good state), `skip` drops the step's update and reports `nonfinite_skipped`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.distributed import device as dev


class NonFiniteError(RuntimeError):
    """A NaN or Inf reached a quantity that would move the weights."""


def _any_rank(flag: torch.Tensor) -> bool:
    """flag: a 1-element float tensor on the device (no host read until the end)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def first_nonfinite(named: dict, mask: torch.Tensor | None = None) -> str | None:
    """Collective: the name of the first tensor (in order) holding a NaN/Inf on any rank
    (where `mask` is set, for [B, R] tensors), with its count; None if all are finite."""
    device = mask.device if mask is not None else next(iter(named.values())).device
    bad = torch.zeros(len(named), device=device)
    for i, t in enumerate(named.values()):
        ok = torch.isfinite(t)
        if mask is not None and t.shape == mask.shape:
            ok = ok | (mask == 0)
        bad[i] = (~ok).sum()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    counts = bad.tolist()
    for name, n in zip(named, counts):
        if n:
            return f"{name} ({int(n)} non-finite values)"
    return None


def grads_nonfinite(ddp_model) -> bool:
    """Collective: does any rank's gradient buffer (megatron DDP) hold a NaN/Inf?"""
    grads = [b.grad_data for b in getattr(ddp_model, "buffers", []) + getattr(ddp_model, "expert_parallel_buffers", [])
             if b.grad_data is not None and b.grad_data.numel()]
    flag = torch.zeros(1, device=dev.current())   # a rank without gradients still votes
    for g in grads:   # one device-side reduction per buffer, one host read in all
        flag = torch.maximum(flag, (~torch.isfinite(g)).any().float().reshape(1))
    return _any_rank(flag)


def report(where: str, step: int, policy: str) -> dict:
    """Stop (raise) or record a skip."""
    message = (f"step {step}: {where}: the update would write NaN/Inf into the weights; "
               f"the newest checkpoint is the last good state (train.on_nonfinite=skip drops such "
               f"a step's update instead of stopping)")
    if policy == "stop":
        raise NonFiniteError(message)
    return {"nonfinite_skipped": 1.0, "nonfinite_reason": message}
