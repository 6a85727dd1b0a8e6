"""Every seed megarl derives from `run.seed`, as pure functions of integers.

A seeded run is reproducible (and a resumed one draws what an uninterrupted one would)
because each seed depends only on the run seed and on where it is used: the epoch, the
step, the prompt's position or number, the sample's index, how far a sample got. Changing
a formula changes every seeded run's results: tests/unit/test_seeds.py pins the values.
"""
from __future__ import annotations

MODULUS = 2**31 - 1   # engine seeds stay below 2**31 (a positive int32)


def epoch_shuffle_seed(run_seed: int, epoch: int) -> int:
    """The prompt sampler's shuffle of `epoch` (data.shuffle)."""
    return run_seed * 1_000_003 + epoch


def step_prompt_seeds(run_seed: int, step: int, count: int) -> list[int]:
    """Synchronous rollout: one seed per prompt of `step`, by its position in the step."""
    return [(run_seed * 1_000_003 + step * 10_007 + i) % MODULUS for i in range(count)]


def group_seed(run_seed: int, gid: int) -> int:
    """Partial rollout: the seed of group `gid` (the gid-th prompt drawn in the run)."""
    return (run_seed * 1_000_003 + gid * 10_007) % MODULUS


def sample_seed(prompt_seed: int, index: int) -> int:
    """Sample `index` of a prompt (or group) seeded `prompt_seed`: each sample of a group draws
    from its own generator, whichever engine serves it."""
    return prompt_seed * 1000 + index


def request_seed(sample_seed: int, tokens: int, restarts: int) -> int:
    """Partial rollout: the next request of a sample that already has `tokens` tokens and was
    restarted `restarts` times, so a rerun (a resume, another engine) draws the same tokens."""
    return (sample_seed * 1_000_003 + tokens * 7919 + restarts * 104_729) % MODULUS


def minibatch_seed(run_seed: int, step: int) -> int:
    """PPO's shuffle of the step's rows into mini-batches (drawn on the host)."""
    return run_seed * 7919 + step


def eval_prompt_seed(run_seed: int, dataset: int, index: int) -> int:
    """Held-out evaluation (eval.temperature > 0): prompt `index` of eval dataset `dataset`, the
    same at every evaluation (each version is scored on the same draws); its samples use
    `sample_seed`. A stream of its own: evaluating draws nothing from the training's seeds."""
    return (run_seed * 1_000_033 + dataset * 100_003 + index * 10_009 + 1) % MODULUS


def mixture_source_seed(run_seed: int, source: int) -> int:
    """A data.prompts mixture: the shuffle seed of source `source` (its epochs reshuffled from
    it as a single file's are from run.seed; source 0 draws the order that file alone would)."""
    return run_seed + source * 104_729


def mixture_pick_seed(run_seed: int, drawn: int) -> int:
    """A data.prompts mixture: which source the `drawn`-th prompt of the run comes from."""
    return (run_seed * 1_000_003 + drawn * 7919 + 17) % MODULUS
