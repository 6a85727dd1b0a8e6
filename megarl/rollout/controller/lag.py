"""`rollout.lag=K`: train each step on the round generated K weight versions earlier.

Staleness that comes from timing (async rounds, partial rollout's carry) varies from step to
step; a study of how training copes with stale data (bench/staleness_study.py) needs it held
fixed. The driver keeps a queue of rounds: each round goes in as it is generated, with the
trainer's l_old of every token computed right then, under the weights that generated it
(stitching's rule, docs/partial_rollout.md: the PPO ratio of a token is against the version
that produced it, so the clip and the stabilizers see the staleness; the behaviour IS weight
sees only the train/inference mismatch). The step trains the oldest round once the queue holds
K + 1: the first step generates K + 1 rounds under the starting weights (so steps 0..K-1 train
rounds 0..K-1 versions old, every later step exactly K), each later step one.

The queue is part of the checkpoint (driver state "lag"): a resumed run trains the rounds the
interrupted one had generated, in order, and none twice.
"""
from __future__ import annotations

import dataclasses
from collections import deque

from megarl.data.sample import Sample
from megarl.rollout import routes


class LagQueue:
    """Rounds (samples, round metrics) waiting `lag` versions before the step trains them."""

    def __init__(self, lag: int):
        if lag < 0:
            raise ValueError(f"rollout.lag={lag}: must be >= 0")
        self.lag = lag
        self.rounds: deque[tuple[list[Sample], dict]] = deque()

    def missing(self) -> int:
        """Rounds to generate before this step can train: 1 once the queue is full, K + 1 at
        the start (and after resuming a checkpoint written without a queue), 0 while a queue
        resumed from a run with a larger lag drains."""
        return max(0, self.lag + 1 - len(self.rounds))

    def put(self, samples: list[Sample], metrics: dict) -> None:
        """A round just generated; every sample's `old_logprobs` must cover its response."""
        short = [i for i, s in enumerate(samples) if len(s.old_logprobs) != len(s.response_ids)]
        if short:
            raise ValueError(f"rollout.lag: sample {short[0]} of a queued round lacks the trainer's "
                             f"logprobs of its tokens (compute them before the weights change)")
        self.rounds.append((samples, metrics))

    def take(self) -> tuple[list[Sample], dict]:
        """The oldest round, once K + 1 are queued."""
        if len(self.rounds) <= self.lag:
            raise RuntimeError(f"rollout.lag={self.lag}: {len(self.rounds)} rounds queued, the step "
                               f"needs {self.lag + 1}")
        return self.rounds.popleft()

    def state_dict(self) -> dict:
        return {"lag": self.lag,
                "rounds": [{"samples": [routes.sample_state(dataclasses.asdict(s)) for s in samples],
                            "metrics": dict(metrics)}
                           for samples, metrics in self.rounds]}

    def load_state_dict(self, state: dict) -> None:
        """The queued rounds of the checkpoint. A checkpoint of another lag keeps its rounds
        (none is lost or trained twice); the queue then refills or drains to this lag."""
        self.rounds = deque(([Sample(**routes.sample_from_state(d)) for d in r["samples"]], dict(r["metrics"]))
                            for r in state["rounds"])
