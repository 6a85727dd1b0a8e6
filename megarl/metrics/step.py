"""Per-step figures computed from a step's samples and timings (one definition each, used by
the trainer, megarl/train.py, and the simulator, megarl/sim/run.py)."""
from __future__ import annotations

from megarl.distributed import device


def trainer_idle_frac(train_s: float, step_s: float, overlap_s: float = 0.0) -> float:
    """Share of a step (or of a run: the sums) in which the trainer does not train: it waits
    for the rollout (all of it in sync mode, what the overlap did not hide in async mode) and
    for the weight push to the engines. `train_s`: stitched logprobs, reward model and update;
    `overlap_s`: the forward-only passes it ran during the round (rollout.overlap), work that
    the rollout time holds but that is not waiting."""
    return 1.0 - (train_s + overlap_s) / step_s


def rollout_metrics(samples, batch) -> dict:
    lengths = [len(s.response_ids) for s in samples]
    mean = sum(lengths) / len(lengths)
    return {"samples": len(samples),
            "response_len_mean": mean,
            "response_len_max": max(lengths),
            # share of decode slots doing useful work when the whole batch waits for its longest
            # sample: what partial rollout wins back
            "rollout_slot_utilization": mean / max(lengths),
            "finished_frac": sum(s.stopped for s in samples) / len(samples),
            **episode_metrics(samples),
            **device.host_values({"reward_mean": batch.scores.mean()})}


def episode_metrics(samples) -> dict:
    """Multi-turn episodes among the samples: turns per episode, observation tokens (context
    the environments appended, mask 0) per episode; nothing for single-turn samples."""
    episodes = [s for s in samples if s.turns or s.mask]
    if not episodes:
        return {}
    obs = [len(s.mask) - sum(s.mask) for s in episodes]
    return {"episode_turns_mean": sum(s.turns for s in episodes) / len(episodes),
            "episode_turns_max": max(s.turns for s in episodes),
            "observation_tokens_mean": sum(obs) / len(episodes),
            "model_tokens_mean": sum(sum(s.mask) for s in episodes) / len(episodes)}
