"""Routing replay in the trainer's forwards: megatron's RouterReplay, driven per model.

A model built with algo.routing_replay other than off (models/transformer_config.py:
moe_enable_routing_replay) has one megatron `RouterReplay` per router. `control_of(model)` wraps
this stage's routers once; `schedule.run_microbatches` calls `before_forward` with each
micro-batch before the model's forward and `end_pass` after the pass. What the routers do then:

- the micro-batch carries routes (`Batch.routes`: the engine's under r3, the trainer's own
  recorded ones under r2): they are replayed (megatron's REPLAY_FORWARD: the router's logits are
  gathered at those experts and softmaxed, so the router still gets gradients); a layer
  recomputed in backward (train.recompute=full) replays the same micro-batch's routes again
  (REPLAY_BACKWARD, megatron's first-in first-out list, in the order of the forwards);
- `recording` is on (r2's old-logprob pass): the routers choose as usual and each choice is
  kept (`take_records`);
- neither: plain routing (dense passes, prompt probes, the critic).

`counting` (r3's old-logprob pass) also compares, per scored token and MoE layer, the replayed
experts with the ones the router would have chosen on the same input (`agreement`); scored are
the positions with engine routes (`Batch.route_lens`), not filler (route_layout.py).

The indices are set per model, not through megatron's global list (`set_replay_data`), which
holds the routers of every model built in the process (actor and reference together).
Megatron keeps each replayed tensor for backward until cleared: `end_pass` clears them after
every pass, so a training pass's recompute never reads a forward-only pass's routes.
"""
from __future__ import annotations

import weakref

import torch
from megatron.core.tensor_parallel.random import is_checkpointing
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from megarl.distributed import parallel
from megarl.ppo import route_layout as layout

_CONTROLS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _unwrap(model):
    while hasattr(model, "module"):   # megatron DDP, Float16Module
        model = model.module
    return model


def control_of(model) -> "RouteReplay | None":
    """The replay control of `model` (made on first use), or None when it was built without
    routing replay (dense models, algo.routing_replay=off)."""
    module = _unwrap(model)
    config = getattr(module, "config", None)
    if not getattr(config, "moe_enable_routing_replay", False):
        return None
    if module not in _CONTROLS:
        _CONTROLS[module] = RouteReplay(module, config)
    return _CONTROLS[module]


def recomputing() -> bool:
    """Inside a layer's recompute during backward (megatron's checkpoint runs the saved
    forward again with gradients on; its first forward runs without)."""
    return is_checkpointing() and torch.is_grad_enabled()


class RouteReplay:
    """One model's routers on this pipeline stage and what they do in the current pass."""

    def __init__(self, module, config):
        self.routers = [m for m in module.modules() if isinstance(m, TopKRouter) and m.router_replay is not None]
        freq = config.moe_layer_freq
        freq = list(freq) if not isinstance(freq, int) else [int(i % freq == 0) for i in range(config.num_layers)]
        self.moe_layers = sum(freq)
        self.columns = layout.stage_columns(freq, [r.layer_number - 1 for r in self.routers])
        self.topk, self.experts = config.moe_router_topk, config.num_moe_experts
        # sequence parallelism: the router sees this TP rank's part of the sequence
        self.tp = parallel.tp_size() if config.sequence_parallel else 1
        self.recording = False
        self.records: list[list[torch.Tensor]] = []   # per micro-batch, per router: [s' * b, k]
        self.counting = False
        self.agreement = None   # on the device: [token-layers with the same set, token-layers scored]
        self._replaying = False
        self._scored = None
        for router in self.routers:
            router.register_forward_pre_hook(self._before_router)
            router.register_forward_hook(self._after_router)

    def check(self, routes: torch.Tensor) -> None:
        """Engine routes [B, L, MoE layers, k] against this model (one clear line if they differ)."""
        layers, k = routes.shape[2:]
        top = int(routes.max()) if routes.numel() else 0
        if layers != self.moe_layers or k != self.topk or top >= self.experts:
            raise ValueError(f"Sample.routes hold {layers} MoE layers x top-{k} with expert ids up to {top}, and the "
                             f"model has {self.moe_layers} MoE layers x top-{self.topk} of {self.experts} experts: "
                             f"the engines must serve model.path's architecture (algo.routing_replay=r3)")

    def before_forward(self, batch) -> None:
        """One micro-batch (a trimmed Batch), before the model's forward on this stage."""
        self._replaying = batch.routes is not None and not self.recording
        if self.recording:
            self.records.append([])
        if not self._replaying or not self.routers:
            return
        routes = batch.routes
        # r2's recorded routes hold this stage's MoE layers, the engine's every MoE layer (which
        # are the same columns when this stage holds them all)
        columns = range(len(self.routers)) if routes.shape[2] == len(self.routers) else self.columns
        rank = parallel.tp_rank() if self.tp > 1 else 0
        for router, idx in zip(self.routers, layout.sequence_major(routes, columns, rank, self.tp)):
            router.router_replay.set_target_indices(idx)
        if self.counting:
            routed = batch.route_lens if batch.route_lens is not None else batch.seq_lens - 1
            self._scored = layout.scored_positions(routed, batch.resp_mask.sum(1) > 0, batch.tokens.shape[1],
                                                   rank, self.tp)

    def _before_router(self, router, args) -> None:
        replay = router.router_replay
        if self.recording:
            replay.set_router_replay_action(RouterReplayAction.RECORD)
        elif self._replaying:
            replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD if recomputing()
                                            else RouterReplayAction.REPLAY_FORWARD)
        else:
            replay.clear_router_replay_action()

    def _after_router(self, router, args, output) -> None:
        if recomputing():
            return
        replay = router.router_replay
        if self.recording:
            self.records[-1].append(replay.get_recorded_indices())
        elif self.counting and self._replaying:
            with torch.no_grad():   # the router's own choice on the same input: one small GEMM
                logits = router.gating(args[0]).reshape(-1, self.experts)
                own = torch.topk(logits, self.topk, dim=-1).indices
                same = layout.same_sets(own, replay.target_topk_idx.to(own.device))[self._scored]
                counts = torch.stack([same.sum().double(), torch.tensor(float(same.numel()), dtype=torch.float64,
                                                                         device=same.device)])
                self.agreement = counts if self.agreement is None else self.agreement + counts

    def end_pass(self) -> None:
        """After a pass: megatron's indices cleared (targets, records, the backward list)."""
        for router in self.routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
        self._replaying, self._scored = False, None

    def take_records(self) -> list[list[torch.Tensor]]:
        out, self.records = self.records, []
        return out

    def take_agreement(self) -> torch.Tensor | None:
        out, self.agreement = self.agreement, None
        return out
