"""The critic's trainer-side work: values and the (clipped) value-loss update."""
from __future__ import annotations

import torch

from megarl.config.schema import AlgoConfig
from megarl.models.builders import Trainable
from megarl.ppo.aggregate import aggregate
from megarl.ppo.batch import Batch, to_response_layout
from megarl.ppo.losses import value_loss
from megarl.ppo.optim import optimizer_step
from megarl.ppo.reports import token_sums
from megarl.ppo.schedule import forward_per_token, local_micro_batches, loss_scale, run_microbatches, sum_reports


def _values(b: Batch, out: torch.Tensor) -> torch.Tensor:
    return to_response_layout(out, b.resp_index).squeeze(-1).float() * b.resp_mask  # [b, R]


def values(critic_model, batch: Batch, layout) -> torch.Tensor:
    """[b, R] value of the state before each response token (forward only); `layout`: the
    micro-batches (schedule.local_micro_batches)."""
    return forward_per_token(critic_model, batch, layout, lambda mb, out: _values(mb["batch"], out))


def update(critic: Trainable, batch: Batch, old_values, returns, algo: AlgoConfig,
           layout, normalizer: float) -> dict:
    """One optimizer step of the critic on this rank's rows of a mini-batch (`layout`: its
    micro-batches, as in actor.update); returns this rank's summed statistics
    (megarl.ppo.reports says how each key reduces)."""
    micro = local_micro_batches(batch, layout)
    scale = loss_scale(len(micro))

    def loss_fn(mb, out):
        b = mb["batch"]
        per_token, stats = value_loss(_values(b, out), mb["old_values"], mb["returns"],
                                      b.resp_mask, algo.value_clip)
        vl = aggregate(per_token, b.resp_mask, algo.loss_agg, normalizer)
        tokens = b.resp_mask.sum()
        return algo.value_coef * vl * scale, {"value_loss": vl.detach(), "tokens": tokens,
                                              **token_sums(stats, tokens)}

    critic.model.zero_grad_buffer()
    critic.optimizer.zero_grad()
    reports = run_microbatches(critic.model, batch, micro, loss_fn, forward_only=False,
                               extras={"old_values": old_values, "returns": returns})
    grad_norm, _ = optimizer_step(critic, "critic")
    return {**sum_reports(reports), "critic_grad_norm": grad_norm}
