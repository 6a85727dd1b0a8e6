"""Run a model over a batch in micro-batches with megatron's pipeline schedules.

The same call serves forward-only passes (old/reference logprobs, values) and training
passes, at any TP x PP: megatron's `get_forward_backward_func` picks the no-pipelining or
1F1B schedule, moves activations between stages and accumulates gradients. Which rows form a
micro-batch and how long it is comes from a Plan (ppo/microbatch.py): each micro-batch is
computed at its own length, not the batch's.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from megarl.distributed import parallel
from megarl.models.masks import causal_mask
from megarl.ppo import moe_metrics
from megarl.ppo.batch import Batch
from megarl.ppo.microbatch import MicroBatch, Plan, plan_batch
from megarl.ppo.routing_replay import control_of


def local_micro_batches(batch: Batch, layout) -> list[MicroBatch]:
    """The micro-batches of `batch` (this rank's rows): `layout` is a list of MicroBatch
    (positions in `batch`, from a Plan made over several ranks: `Plan.local`), or a Batching /
    a micro-batch size, planned here over these rows alone."""
    if isinstance(layout, (list, tuple)):
        return list(layout)
    return list(plan_batch(batch, layout, 1).ranks[0])


def _index(rows: tuple[int, ...], device: torch.device):
    """Rows as an index: a slice where they are consecutive (a Plan's local micro-batches
    always are: no index tensor to copy to the device per micro-batch), else a tensor."""
    if rows and rows == tuple(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, dtype=torch.long, device=device)


def micro_inputs(batch: Batch, mb: MicroBatch, extras: dict) -> dict:
    """One micro-batch's inputs: its rows of `batch` trimmed to its own length and width
    (filler rows with mask 0), and its rows of each tensor in `extras` ([b, R] ones trimmed
    to the width too)."""
    idx = _index(mb.rows, batch.device)
    sub = batch.select(idx).trim(mb.length, mb.width)
    if mb.fill:   # filler rows: computed so every DP rank runs as many micro-batches, never trained
        sub.resp_mask = sub.resp_mask.clone()
        sub.resp_mask[len(mb.rows) - mb.fill:] = 0
    width = batch.resp_mask.shape[1]
    out = {"batch": sub}
    for k, v in extras.items():
        v = v[idx]
        out[k] = v[:, :mb.width] if v.dim() >= 2 and v.shape[1] == width else v
    return out


def run_microbatches(model, batch: Batch, layout, loss_fn: Callable,
                     forward_only: bool, extras: dict | None = None) -> list[dict]:
    """Forward (and backward unless forward_only) over `batch` in micro-batches
    (`local_micro_batches(batch, layout)`), each its own [b, length] shape.

    loss_fn(mb: dict, output [b, length, ...]) -> (loss 0-d tensor, report dict); `mb` holds
    the micro-batch's Batch (trimmed) under "batch" and its rows of each tensor in `extras`.
    Returns the report dicts of this rank's micro-batches, in order (empty off the last PP
    stage). megatron divides each micro-batch loss by the number of micro-batches; loss_fn's
    losses are already normalised by the global batch, so callers scale by `loss_scale`.
    Shapes vary between micro-batches: with PP > 1 the model's config has
    variable_seq_lengths (models/transformer_config.py), so each p2p message carries its shape.
    """
    micro = local_micro_batches(batch, layout)
    data = [micro_inputs(batch, mb, extras or {}) for mb in micro]
    masks: dict[int, tuple] = {}
    replay = control_of(model)   # MoE routing replay (ppo/routing_replay.py); None without it

    def inputs_of(length: int):
        if length not in masks:
            masks[length] = (causal_mask(length, batch.device),
                             torch.arange(length, device=batch.device).unsqueeze(0))
        return masks[length]

    def forward_step(data_iterator, model_chunk):
        mb = next(data_iterator)
        if replay is not None:
            replay.before_forward(mb["batch"])
        tokens = mb["batch"].tokens
        mask, positions = inputs_of(tokens.shape[1])
        # an MoE model's routers learn and are measured on real tokens only (ppo/moe_metrics.py)
        output = model_chunk(tokens, positions.expand_as(tokens), mask, **moe_metrics.padding_mask(model, mb["batch"]))
        return output, partial(loss_fn, mb)

    try:
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(data), model=[model],
            num_microbatches=len(micro), seq_length=max(mb.length for mb in micro),
            micro_batch_size=max(len(mb.rows) for mb in micro), forward_only=forward_only)
    finally:
        if replay is not None:
            replay.end_pass()


def sum_reports(reports: list[dict]) -> dict:
    """Per-key sums of micro-batch reports, left on the device: the step reduces them over
    ranks and copies them to the host once (ppo/step.py)."""
    return {k: sum(r[k].detach() for r in reports) for k in reports[0]} if reports else {}


def loss_scale(num_microbatches: int) -> float:
    """Undo megatron's mean over micro-batches and DP ranks: our losses are global sums."""
    return float(num_microbatches * parallel.dp_size())


def share_from_last_stage(t: torch.Tensor | None, shape, device: torch.device,
                          dtype=torch.float) -> torch.Tensor:
    """Every PP stage gets the last stage's result (forward-only outputs live there)."""
    if parallel.pp_size() == 1:
        return t
    if not parallel.is_last_stage():
        t = torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(t, src=parallel.last_stage_global_rank(), group=parallel.pp_group())
    return t


def forward_per_token(model, batch: Batch, layout, fn: Callable) -> torch.Tensor:
    """Forward-only pass returning fn(mb, output) -> [b, width] for each micro-batch of this
    rank's rows, assembled into [B, R] (zeros past each micro-batch's width), on every PP
    stage. No gradients are kept. `layout`: as in `local_micro_batches`."""
    micro = local_micro_batches(batch, layout)

    def loss_fn(mb, output):
        with torch.no_grad():
            value = fn(mb, output)
        return torch.zeros((), device=value.device), {"value": value}

    with torch.no_grad():
        reports = run_microbatches(model, batch, micro, loss_fn, forward_only=True)
    local = None
    if reports:
        local = torch.zeros(tuple(batch.resp_mask.shape), dtype=reports[0]["value"].dtype, device=batch.device)
        for mb, r in zip(micro, reports):
            local[_index(mb.rows, batch.device), :r["value"].shape[1]] = r["value"]
    return share_from_last_stage(local, tuple(batch.resp_mask.shape), batch.device)


def forward_all(fn: Callable, model, batch: Batch, layout) -> torch.Tensor:
    """[B, R] of `fn(model, rows, micro_batches) -> [b, R]` over the whole batch: `layout`'s
    plan over the DP ranks (a Plan of this batch's rows, made once for all of a step's passes,
    or a Batching / a micro-batch size planned here), this rank's rows computed in its
    micro-batches, every rank's gathered back into the batch's row order."""
    plan = layout if isinstance(layout, Plan) else plan_batch(batch, layout, parallel.dp_size())
    rows, micro, _ = plan.local(parallel.dp_rank())
    return gather_planned(fn(model, batch.select(rows), micro), plan, batch.size)


def gather_planned(local: torch.Tensor, plan: Plan, count: int) -> torch.Tensor:
    """Every DP rank's rows of a plan (this rank's: `local`, in `Plan.local` order) put back
    at their positions in a [count, ...] tensor; filler rows dropped. Ranks hold different row
    counts: each share is padded to the largest for the all-gather."""
    dp = len(plan.ranks)
    shares = [plan.local(r) for r in range(dp)]
    if dp > 1:
        most = max(len(rows) for rows, _, _ in shares)
        padded = torch.zeros((most, *local.shape[1:]), dtype=local.dtype, device=local.device)
        padded[:local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(dp)]
        dist.all_gather(parts, padded, group=parallel.dp_group())
    else:
        parts = [local]
    out = torch.zeros((count, *local.shape[1:]), dtype=local.dtype, device=local.device)
    for part, (rows, _, real) in zip(parts, shares):
        keep = [j for j, r in enumerate(real) if r]
        at = torch.tensor([rows[j] for j in keep], dtype=torch.long, device=local.device)
        out[at] = part[torch.tensor(keep, dtype=torch.long, device=local.device)]
    return out
