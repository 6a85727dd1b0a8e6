"""What an MoE actor's routers did during a step's updates (docs/moe.md "Metrics").

megatron-core computes the router losses and keeps them in its layer-wise tracker
(`moe_utils.get_moe_layer_wise_logging_tracker`, one value per layer, summed over the
micro-batches that ran with gradients); the router's forward returns its routing map, whose
column sums are the tokens each expert was given. `RouterStats` hooks the actor's routers:

- each router call made with gradients (the update passes; forward-only passes run under
  no_grad, and a recomputed layer's first pass too, exactly where megatron records its losses)
  adds its routing map's real tokens per expert (megatron's `padding_mask`, which
  `padding_mask` below builds for every micro-batch, excludes the padding and the filler
  rows, which megatron's router losses then neither count nor train on) and what it added
  to the tracker: the difference around the call, so a critic or reference built from the
  same MoE checkpoint, whose routers write into the same global tracker, is not counted;
- at the step's end `collect` puts the actor's per-layer means (per micro-batch, as megatron
  scales them) back into the tracker and reduces them with megatron's own
  `reduce_aux_losses_tracker_across_ranks` (sum over PP stages; the load-balancing losses as
  the routers declared them; the z-loss, which megatron leaves per rank, as a mean over every
  real token of the step), sums the token counts over DP (EP included) and PP, summarises them
  (`summarise`: pure) and clears the tracker.

Every rank returns the same numbers, and every layout the same token shares and z-loss on the
same data; the load-balancing loss is megatron's per micro-batch value, equal where the
layouts' micro-batches hold the same rows.
"""
from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe import router as moe_router
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.utils import get_model_config

from megarl.distributed import device as dev
from megarl.distributed import parallel

#: megatron's tracker name of each moe.load_balancing (router.py)
LOAD_BALANCING_LOSSES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                         "global_aux_loss": "global_load_balancing_loss"}
Z_LOSS = "z_loss"


def summarise(losses: dict[str, list[float]], counts: list[list[int]]) -> dict[str, float]:
    """The step's router metrics from per-layer figures (one entry per transformer layer; a
    layer whose counts are all zero holds no router, or it routed nothing, and is left out):

    - `losses`: megatron tracker name -> per-layer loss value (the loss without its
      coefficient); a load-balancing loss becomes moe_aux_loss (1.0: balanced), the z-loss
      moe_z_loss, each the mean over the MoE layers, with its _max over them;
    - `counts`: per layer, the tokens routed to each expert (a token counts once per expert it
      is routed to). An expert's share is its part of a layer's routed tokens (1 / experts:
      balanced); moe_expert_share_max / _min are the largest and smallest over every layer,
      moe_imbalance the largest share x experts (1.0: balanced; experts / top-k: every token
      on the same experts), the mean over layers, moe_imbalance_max the worst layer's.
    """
    layers = [i for i, row in enumerate(counts) if sum(row) > 0]
    if not layers:
        return {}
    experts = len(counts[layers[0]])
    shares = [[c / sum(counts[i]) for c in counts[i]] for i in layers]
    imbalance = [max(s) * experts for s in shares]
    out = {"moe_expert_share_max": max(max(s) for s in shares),
           "moe_expert_share_min": min(min(s) for s in shares),
           "moe_imbalance": sum(imbalance) / len(imbalance),
           "moe_imbalance_max": max(imbalance)}
    for name, values in losses.items():
        key = "moe_z_loss" if name == Z_LOSS else "moe_aux_loss"
        picked = [values[i] for i in layers]
        out[key] = sum(picked) / len(picked)
        out[f"{key}_max"] = max(picked)
    return out


def loss_names(config) -> list[str]:
    """The tracker names megatron's routers write under a TransformerConfig, in order."""
    names = []
    kind = config.moe_router_load_balancing_type
    if kind in LOAD_BALANCING_LOSSES and (config.moe_aux_loss_coeff or 0) > 0:
        names.append(LOAD_BALANCING_LOSSES[kind])
    if config.moe_z_loss_coeff:
        names.append(Z_LOSS)
    return names


def padding_mask(model, batch) -> dict:
    """The `padding_mask` keyword of an MoE model's forward for one micro-batch ({} for a dense
    model): [b, L] True past each row's prompt + response and on every token of a row that
    trains none (`batch.resp_mask` 0 everywhere: a filler row, computed only so every DP rank
    runs as many micro-batches, ppo/microbatch.py), so megatron's router losses (their
    gradients included) and the token counts cover the real tokens only. megatron splits it
    over the sequence-parallel ranks on the first pipeline stage but passes it whole to the
    later ones, whose routers see their share of the sequence: there it is split here."""
    config = get_model_config(model)
    if not config.num_moe_experts:
        return {}
    _guard_empty_micro_batches()
    length = batch.tokens.shape[1]
    mask = torch.arange(length, device=batch.tokens.device).unsqueeze(0) >= batch.seq_lens.unsqueeze(1)
    mask = mask | (batch.resp_mask.sum(1) == 0).unsqueeze(1)   # the rows routing replay does not score either
    if config.sequence_parallel and not parallel.is_first_stage():
        mask = tensor_parallel.scatter_to_sequence_parallel_region(mask.t().contiguous()).t().contiguous()
    return {"padding_mask": mask}


def _guard_empty_micro_batches() -> None:
    """Once per process: megatron's load-balancing losses divide by the micro-batch's real
    token count (router.py, `get_tokens_per_expert_and_token_count`), which a micro-batch of
    filler rows alone has none of: 0 / 0, a NaN loss and NaN gradients. Counted as 1 there, as
    megatron's z-loss already clamps its count, such a loss is 0 with a zero gradient (its
    tokens per expert are all 0, its scores masked); a count above 0 is left as it is."""
    if getattr(moe_router.get_tokens_per_expert_and_token_count, "megarl_guarded", False):
        return
    count = moe_router.get_tokens_per_expert_and_token_count

    def guarded(routing_map, reduce_group, topk=None, with_padding_mask=False):
        per_expert, local, total = count(routing_map, reduce_group, topk=topk, with_padding_mask=with_padding_mask)
        if with_padding_mask:
            total = torch.where(total > 0, total, torch.ones_like(total))
        return per_expert, local, total

    guarded.megarl_guarded, guarded.original = True, count
    moe_router.get_tokens_per_expert_and_token_count = guarded


class RouterStats:
    """The actor's router statistics of the current step (module docstring)."""

    def __init__(self, model, config):
        self.config = config
        self.names = loss_names(config)
        # on the device (no host copy per router call)
        self.counts = torch.zeros(config.num_layers, config.num_moe_experts, dtype=torch.long, device=dev.current())
        self.calls = torch.zeros(config.num_layers, dtype=torch.long, device=dev.current())  # that routed real tokens
        self.tokens = torch.zeros(config.num_layers, dtype=torch.float64, device=dev.current())  # real ones routed
        self.losses: dict[str, torch.Tensor] = {}
        self._before: dict[str, torch.Tensor] = {}
        for router in (m for m in model.modules() if isinstance(m, TopKRouter)):
            router.register_forward_pre_hook(self._snapshot)
            router.register_forward_hook(self._record, with_kwargs=True)

    @classmethod
    def of(cls, trainable) -> "RouterStats | NoRouters":
        """The trainable's statistics, hooked on first use and reset for a new step (a step
        that stopped early, on a non-finite value, left its figures behind)."""
        config = trainable.info.config
        if not config.num_moe_experts:
            return NoRouters()
        stats = getattr(trainable, "router_stats", None)
        if stats is None:
            stats = cls(trainable.model, config)
            trainable.router_stats = stats   # the hooks stay on the model: one object per trainable
        stats.reset()
        return stats

    def reset(self) -> None:
        self.counts.zero_()
        self.calls.zero_()
        self.tokens.zero_()
        self.losses.clear()
        moe_utils.clear_aux_losses_tracker()

    @staticmethod
    def _tracked(router) -> bool:
        return router.training and torch.is_grad_enabled()   # megatron's own condition (router.py)

    def _snapshot(self, router, args) -> None:
        if self._tracked(router):
            tracker = moe_utils.get_moe_layer_wise_logging_tracker()
            self._before = {name: entry["values"].clone() for name, entry in tracker.items()}

    def _record(self, router, args, kwargs, output) -> None:
        if not self._tracked(router):
            return
        routing_map = output[1]
        pad = args[1] if len(args) > 1 else kwargs.get("padding_mask")
        tokens = routing_map.shape[0]
        if pad is not None:
            valid = ~pad.reshape(-1, 1)
            routing_map, tokens = routing_map & valid, valid.sum()
        layer = router.layer_number - 1
        self.counts[layer] += routing_map.sum(dim=0)
        self.calls[layer] += tokens > 0   # a filler micro-batch's call: no real token, no loss (not a 0 in the mean)
        self.tokens[layer] += tokens
        for name, entry in moe_utils.get_moe_layer_wise_logging_tracker().items():
            before = self._before.get(name)
            added = entry["values"] - before if before is not None else entry["values"].clone()
            if name == Z_LOSS:   # a mean over this call's real tokens: kept as their sum (`collect`)
                added = added * tokens
            self.losses[name] = self.losses[name] + added if name in self.losses else added
        self._before = {}

    def collect(self) -> dict[str, float]:
        """The step's metrics (`summarise`), the same on every rank; collective over all
        trainer ranks. Clears megatron's tracker."""
        device = self.counts.device
        counts = self.counts.clone()
        parallel.all_reduce_sum(counts, parallel.dp_group())   # EP ranks are DP ranks
        if self.config.sequence_parallel:   # each TP rank routed its share of the sequence
            parallel.all_reduce_sum(counts, parallel.tp_group())
        tokens = parallel.all_reduce_sum(self.tokens.clone(), parallel.tp_dp_group())   # as the z-loss sums
        if parallel.pp_size() > 1:
            parallel.all_reduce_sum(counts, parallel.pp_group())
            parallel.all_reduce_sum(tokens, parallel.pp_group())
        per_call = self.calls.clamp(min=1).to(device=device, dtype=torch.float32)
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        for name in self.names:
            values = self.losses.get(name, torch.zeros(self.config.num_layers, device=device)).to(device)
            values = values.double() if name == Z_LOSS else values.float() / per_call
            tracker[name] = {"values": values, **_groups(name)}
        moe_utils.reduce_aux_losses_tracker_across_ranks(self.names)
        losses = {name: (tracker[name]["values"] / tokens.clamp(min=1) if name == Z_LOSS   # per real token
                         else tracker[name]["values"]).tolist() for name in self.names}
        self.reset()   # zeroes the tracker's tensors: read before
        return summarise(losses, counts.tolist())


def _groups(name: str) -> dict:
    """How megatron's reduction treats a tracker entry: as the routers declare it for the
    load-balancing losses (router.py; megarl has no context parallelism, so TP x CP is TP);
    the z-loss, which the routers record per rank as a mean over their own real tokens (under
    sequence parallelism a TP rank's part of the sequence, mostly padding at its end), as sums
    over every TP x DP rank's tokens (`_record`), divided by their count after the reduction."""
    if name in (LOAD_BALANCING_LOSSES["global_aux_loss"], Z_LOSS):
        return {"reduce_group": parallel.tp_dp_group(), "avg_group": None, "reduce_group_has_dp": True}
    return {"reduce_group": parallel.tp_group(), "avg_group": None, "reduce_group_has_dp": False}


class NoRouters:
    """A dense model's: nothing to report."""

    def collect(self) -> dict[str, float]:
        return {}
