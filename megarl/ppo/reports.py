"""Update reports -> step metrics: every reported statistic reduces by one rule, its key's suffix.

The actor's and the critic's `update` return sums over this rank's micro-batches (tensors stay
on the device); the step adds them over its updates (`add`), sums them over the ranks in one
collective (`sum_over_ranks`) and turns the totals into metrics (`to_metrics`):

  "tokens"     response tokens a model trained on: the denominator of that model's `_sum`s (the
               actor's and the critic's are kept apart: `add(..., model)`), not a metric itself.
  "<x>_sum"    a sum over tokens of a per-token quantity -> metric "<x>" = total / tokens
               (entropy_sum -> entropy). A statistic a loss computes as a token mean over its
               micro-batch is reported as mean * tokens (`token_sums`): clip_frac_sum -> clip_frac.
  "<x>_norm"   a value that is already global per update, the same on every DP rank (gradient
               norms: megatron reduces them over the model's ranks) -> its mean over DP ranks
               and updates.
  any other    this rank's share of a per-update value (a loss aggregated with the global
               normaliser): summed over micro-batches and DP ranks -> its mean over updates.

A new statistic therefore reaches the metrics by being reported; nothing lists the keys.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

#: metrics every step has, 0 when the loss behind them did not run (grpo has no critic; ppo's
#: critic warm-up steps no actor), so every row of metrics.jsonl holds them
ALWAYS = ("policy_loss", "value_loss", "clip_frac", "entropy", "grad_norm", "critic_grad_norm")


def token_sums(means: dict, tokens: torch.Tensor) -> dict:
    """Token means over one micro-batch (e.g. a loss's clip_frac) as `<x>_sum` token sums, which
    add up over micro-batches, updates and ranks."""
    return {f"{k}_sum": v * tokens for k, v in means.items()}


def add(acc: dict, report: dict, model: str = "") -> None:
    """Add one update's report of `model` (e.g. "actor", "critic") into `acc`; tensors stay on
    the device until `sum_over_ranks`. Only numbers count (a bool is a flag, not a statistic).
    Each model's statistics are kept apart (under "<model>/<key>"): each reports its own
    `tokens`, and a `_sum` divides by the tokens of the model that reported it."""
    for k, v in report.items():
        if isinstance(v, (int, float, torch.Tensor)) and not isinstance(v, bool):
            key = f"{model}/{k}" if model else k
            acc[key] = acc.get(key, 0.0) + v


def sum_over_ranks(sums: dict, device: torch.device, own: bool) -> dict:
    """Collective over the world: per key, the sum of `sums` over the ranks where `own` (one copy
    per DP rank: the last PP stage's TP rank 0, where the reports are); other ranks add 0.

    Ranks may hold different keys (the loss reports exist on the last stage only), so the key
    names are gathered first; then one all-reduce and one device-to-host copy for all values."""
    keys = sorted(sums)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        every: list = [None] * world
        dist.all_gather_object(every, keys)
        keys = sorted(set().union(*every))
    if not keys:
        return {}
    zero = torch.zeros((), dtype=torch.float64, device=device)
    vec = torch.stack([torch.as_tensor(sums.get(k, 0.0), dtype=torch.float64, device=device).reshape(())
                       if own else zero for k in keys])
    if world > 1:
        dist.all_reduce(vec)
    return dict(zip(keys, vec.cpu().tolist()))


def to_metrics(totals: dict, updates: int, dp_size: int) -> dict:
    """Step metrics from the totals over ranks (`sum_over_ranks`), by the rule of the module doc.

    updates: optimizer updates in the step (ppo_epochs * mini_batches); dp_size: DP ranks."""
    out = dict.fromkeys(ALWAYS, 0.0)
    for key, v in totals.items():
        model, _, k = key.rpartition("/")
        if k == "tokens":
            continue
        tokens = max(totals.get(f"{model}/tokens" if model else "tokens", 0.0), 1.0)
        if k.endswith("_sum"):
            out[k[:-len("_sum")]] = v / tokens
        elif k.endswith("_norm"):
            out[k] = v / dp_size / updates
        else:
            out[k] = v / updates
    return out
