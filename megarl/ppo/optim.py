"""The optimizer step of a trainable model (actor or critic), guarded against NaN/Inf gradients."""
from __future__ import annotations

from megarl.distributed import faults
from megarl.ppo.nonfinite import NonFiniteError, grads_nonfinite


def optimizer_step(trainable, name: str, align=None) -> tuple[float, dict]:
    """The optimizer and LR-schedule step of `trainable` (actor or critic), refused when its
    gradients hold a NaN/Inf (collective: every rank stops or skips together). Returns the
    global gradient norm (0 when megatron reports none) and the gradient-alignment statistics
    (`align`, a ppo/grad_align.py GradAlign: it sees the reduced gradient before clipping;
    {} without it).

    megatron's own "update successful" flag is False only when fp16 loss scaling found an
    overflow; megarl trains in float32 or bfloat16 (model.dtype), where it is always True, and
    the guard above has already refused non-finite gradients, so it is not returned."""
    faults.point("update")
    if grads_nonfinite(trainable.model):
        raise NonFiniteError(f"{name} gradients")
    if align is None:
        _, grad_norm, _ = trainable.optimizer.step()
        stats = {}
    else:
        grad_norm, stats = align.step(trainable.optimizer)
    trainable.scheduler.step(increment=trainable.schedule_increment)
    return float(grad_norm or 0.0), stats
