"""Routing replay's routes in a plan (algo.routing_replay, docs/moe.md "Routing replay"): pure
arithmetic on the architecture facts and the trainer's layout, counting what megarl keeps.

- the engines' routes (r3 only: rollout/routes.py asks for them under r3) travel with each
  sample through the controller, in host memory of global rank 0: per sample its input tokens
  (prompt + response - 1) x MoE layers x top-k ids, 1 byte each (2 past 255 experts);
- every trainer rank holds the step's whole batch of routes on its device, padded to the
  batch's length ([samples, length, MoE layers, top-k], ppo/route_layout.batch_routes): the
  engine's under r3, under r2 the ones its old-logprob pass recorded for this stage's MoE layers
  (ppo/replay_step.recorded_routes);
- within a pass, megatron's RouterReplay keeps each micro-batch's int64 [tokens, top-k] indices
  per router of the stage until the pass ends (its backward list, cleared by end_pass), as r2's
  recording keeps the routers' int64 choices: the largest pass, the old-logprob pass over this
  DP rank's share of the step, holds them for all its rows (1/TP of the positions under
  sequence parallelism).
Sequences are bounded by rollout.engines.max_model_len, as the activations are.
"""
from __future__ import annotations

from megarl.models.arch import Arch

INDEX_BYTES = 8   # the int64 indices megatron's router gathers with


def id_bytes(a: Arch) -> int:
    """Bytes of one expert id as stored (engine uint8 / trainer uint8 up to 256 experts, else 2)."""
    return 1 if a.experts <= 256 else 2


def moe_layers(a: Arch, layers=None) -> int:
    """MoE layers among `layers` (every layer of the model when None)."""
    return sum(1 for i in (range(a.layers) if layers is None else layers) if a.is_sparse(i))


def host_route_bytes(mode: str, a: Arch, samples: int, seq: int) -> float:
    """The engines' routes of one step's samples on the controller (global rank 0's host):
    r3 only, seq - 1 input tokens per sample at most."""
    if mode != "r3" or not a.moe:
        return 0.0
    return samples * (seq - 1) * moe_layers(a) * a.top_k * id_bytes(a)


def device_route_bytes(mode: str, a: Arch, samples: int, seq: int, dp: int, stage_layers,
                       tp_split: int = 1) -> float:
    """Peak route bytes on one trainer GPU of the stage holding `stage_layers`: the step's batch
    of routes (every MoE layer under r3, the stage's under r2) and the int64 indices of the
    largest pass (samples / dp rows, the stage's MoE layers, 1/tp_split of the positions with
    sequence parallelism). 0 with replay off or a dense model."""
    if mode == "off" or not a.moe:
        return 0.0
    held = moe_layers(a, stage_layers)
    kept = moe_layers(a) if mode == "r3" else held
    batch = samples * seq * kept * a.top_k * id_bytes(a)
    indices = samples / dp * seq / tp_split * held * a.top_k * INDEX_BYTES
    return batch + indices
