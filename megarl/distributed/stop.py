"""A stop every rank agrees on: SIGTERM (slurm pre-emption) or a wall-clock budget.

Each rank votes after a step; an all-reduce MAX makes one rank's SIGTERM everyone's, so all
ranks reach the final checkpoint together instead of some hanging in a collective.

Before the first step there is nothing to save, but a wait can be long (the engines' start:
up to rollout.engines.start_timeout_s, 30 min by default): inside `interruptible()` a SIGTERM
raises `Stopped` in the waiting thread, so a pre-empted job stops in seconds instead of after
the start and a whole step, when the scheduler's grace period is long over. The trainer does
the same with the other long waits outside a step (train.py): the first weight push on a single
trainer rank, and an evaluation's generation at the top of a step; every rank votes
(`should_stop`) right after them and stops before the step.
"""
from __future__ import annotations

import contextlib
import signal
import time

import torch
import torch.distributed as dist

from megarl.distributed import device


class Stopped(BaseException):
    """A SIGTERM inside `StopSignal.interruptible()`. A BaseException, as KeyboardInterrupt:
    handlers of errors (`except Exception`) on the way up must not swallow a stop."""


class StopSignal:
    def __init__(self, budget_min: float = 0.0):
        self.start = time.monotonic()
        self.budget_s = budget_min * 60.0
        self.signalled = False
        self.reason = ""
        self._raise = False             # inside interruptible(): the next SIGTERM raises Stopped
        signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, signum, frame):
        self.signalled = True
        if self._raise:
            self._raise = False         # once: the cleanup on the way up is not cut short again
            raise Stopped("SIGTERM")

    @contextlib.contextmanager
    def interruptible(self):
        """A SIGTERM before or during the block raises Stopped in this (the main) thread."""
        if self.signalled:
            raise Stopped("SIGTERM")
        self._raise = True
        try:
            yield
        finally:
            self._raise = False

    def should_stop(self) -> bool:
        """Collective: True on every rank if any rank was signalled or the budget is spent."""
        over = self.budget_s > 0 and time.monotonic() - self.start > self.budget_s
        vote = torch.tensor([float(self.signalled), float(over)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            vote = device.put(vote)   # NCCL reduces device tensors only
            dist.all_reduce(vote, op=dist.ReduceOp.MAX)
        signalled, over = vote.tolist()
        self.reason = "SIGTERM" if signalled else ("time budget" if over else "")
        return bool(self.reason)
