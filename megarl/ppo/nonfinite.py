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


class NonFiniteError(RuntimeError):
    """A NaN or Inf reached a quantity that would move the weights."""


def _any_rank(flag: bool, device: torch.device) -> bool:
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


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
    flag = False
    device = None
    for buf in getattr(ddp_model, "buffers", []) + getattr(ddp_model, "expert_parallel_buffers", []):
        if buf.grad_data is not None and buf.grad_data.numel():
            device = buf.grad_data.device
            flag = flag or not bool(torch.isfinite(buf.grad_data).all())
    return _any_rank(flag, device or torch.device("cpu"))


def report(where: str, step: int, policy: str) -> dict:
    """Stop (raise) or record a skip."""
    message = (f"step {step}: {where}: the update would write NaN/Inf into the weights; "
               f"the newest checkpoint is the last good state (train.on_nonfinite=skip drops such "
               f"a step's update instead of stopping)")
    if policy == "stop":
        raise NonFiniteError(message)
    return {"nonfinite_skipped": 1.0, "nonfinite_reason": message}
