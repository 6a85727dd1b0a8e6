"""What algo.routing_replay changes in a PPO/GRPO step (docs/moe.md "Routing replay").

- off: the batch's routes are dropped; every forward routes on its own.
- r3: the engine's routes (Sample.routes, in `Batch.routes`) are replayed in every forward of
  the actor and the reference over the batch (old logprobs, reference logprobs, each update):
  the logprobs of the sampled tokens are those of the experts that sampled them. The step
  refuses a batch with a sample whose routes stop before a trained token (positions past its
  last trained token take filler experts: ppo/route_layout.py). The old-logprob pass also
  measures routing agreement (the share of token-layers with engine routes where the trainer's
  router, on the same input, picks the same set).
- r2: the old-logprob pass routes on its own and records its choices; the step's updates
  replay them, so the ratio pi / l_old compares the same experts across the step's updates
  (the reference routes on its own).
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from megarl.distributed import device as dev
from megarl.distributed import parallel
from megarl.ppo import route_layout as layout
from megarl.ppo.batch import Batch
from megarl.ppo.microbatch import Plan
from megarl.ppo.routing_replay import RouteReplay, control_of
from megarl.ppo.schedule import gather_planned


class StepReplay:
    """One step's routing replay: `batch` for the forward-only passes, `old_pass` around the
    old-logprob pass, `train_batch` for the updates, `metrics`."""

    def __init__(self, mode: str, actor_model, batch: Batch):
        self.mode = mode
        self.control: RouteReplay | None = control_of(actor_model) if mode != "off" else None
        self.batch = batch if mode == "r3" else replace(batch, routes=None, route_lens=None)
        self.train_batch = self.batch
        if mode == "r3":
            if batch.routes is None:
                raise ValueError(missing_routes("this step's batch"))
            if self.control is not None:
                self.control.check(batch.routes)

    def old_pass(self, run, plan: Plan) -> torch.Tensor:
        """`run()`: the old-logprob pass over `self.batch` planned by `plan`; r2 records the
        actor's choices there (replayed by the updates), r3 counts agreement."""
        control = self.control
        if control is None:
            return run()
        control.recording, control.counting = self.mode == "r2", self.mode == "r3"
        try:
            out = run()
        finally:
            control.recording = control.counting = False
        if self.mode == "r2":
            routes = recorded_routes(control, self.batch, plan)
            self.train_batch = replace(self.batch, routes=routes)
        return out

    @property
    def route_bytes(self) -> int:
        """The routes the updates replay on this rank (the engine's, or r2's recorded ones)."""
        routes = self.train_batch.routes
        return routes.numel() * routes.element_size() if routes is not None else 0

    def metrics(self) -> dict:
        """routing_agreement (r3: over every rank's scored token-layers of the old-logprob pass)
        and train_route_bytes (the routes the step holds on this rank: the engine's, or r2's recorded
        ones of this stage's layers)."""
        out = {"train_route_bytes": float(self.route_bytes)} if self.mode != "off" else {}
        if self.mode != "r3" or self.control is None:
            return out
        counts = self.control.take_agreement()
        device = self.batch.device
        counts = torch.zeros(2, dtype=torch.float64, device=device) if counts is None else counts.to(device)
        if self.control.tp == 1 and parallel.tp_rank() != 0:   # TP ranks route the same tokens: count once
            counts = torch.zeros_like(counts)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        same, scored = counts.tolist()
        if scored:
            out["routing_agreement"] = same / scored
        return out


def missing_routes(what: str) -> str:
    return (f"algo.routing_replay=r3 replays the engine's expert choices, and {what} holds samples without them "
            f"for tokens that train (Sample.routes): run engines that capture them (docs/moe.md \"Routing replay\"), "
            f"or set algo.routing_replay=r2 or off")


_WIRE = (torch.uint8, torch.int16, torch.int32)   # route_layout.route_dtype's choices


def share_routes(samples: list | None, shape: tuple, device: torch.device) -> torch.Tensor:
    """Global rank 0's samples' routes as [count, length, MoE layers, k] (`shape`: the tokens'
    [count, length]) on every rank: a header, then the tensor (two broadcasts). Raises on every
    rank when a sample of rank 0's lacks routes for a trained token (algo.routing_replay=r3).
    The carry's pass scores no routing agreement, so the routed lengths stay behind."""
    routes = layout.batch_routes(samples, shape[1]) if samples else None
    head = [0, 0, 0, 0] if routes is None else [1, *routes.shape[2:], _WIRE.index(routes.dtype)]
    head = dev.put(torch.tensor(head, dtype=torch.long), device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        dist.broadcast(head, src=0)
    known, layers, k, code = head.cpu().tolist()
    if not known:
        raise ValueError(missing_routes("the carry (partial rollout, rollout.lag)"))
    routes = (dev.put(routes, device) if routes is not None
              else torch.empty((*shape, layers, k), dtype=_WIRE[code], device=device))
    if world > 1:
        dist.broadcast(routes, src=0)
    return routes


def recorded_routes(control: RouteReplay, batch: Batch, plan: Plan) -> torch.Tensor:
    """[B, L, this stage's MoE layers, k]: the choices the routers recorded in a pass of `plan`
    over `batch` (this DP rank's micro-batches, in order), every DP rank's gathered; experts
    0..k-1 past each micro-batch's length."""
    rows, micro, _ = plan.local(parallel.dp_rank())
    records = control.take_records()
    if len(records) != len(micro):
        raise RuntimeError(f"routing replay recorded {len(records)} micro-batches of a pass of {len(micro)}")
    k, length = control.topk, batch.tokens.shape[1]
    local = layout.filler((len(rows), length, len(control.routers), k), k,
                          layout.route_dtype(control.experts - 1)).to(batch.device)
    for mb, per_layer in zip(micro, records):
        at = torch.tensor(mb.rows, dtype=torch.long, device=batch.device)
        for j, idx in enumerate(per_layer):
            part = _whole_sequence(layout.batch_major(idx, len(mb.rows)), control.tp)
            local[at, :part.shape[1], j] = part.to(local.dtype)
    return gather_planned(local, plan, batch.size)


def _whole_sequence(part: torch.Tensor, tp: int) -> torch.Tensor:
    """[b, s', k] of this TP rank's part of the sequence (sequence parallelism) -> [b, s, k]."""
    if tp == 1:
        return part
    parts = [torch.empty_like(part) for _ in range(tp)]
    dist.all_gather(parts, part.contiguous(), group=parallel.tp_group())
    return torch.cat(parts, dim=1)
