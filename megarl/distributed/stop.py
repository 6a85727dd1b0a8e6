"""A stop every rank agrees on: SIGTERM (slurm pre-emption) or a wall-clock budget.

Each rank votes after a step; an all-reduce MAX makes one rank's SIGTERM everyone's, so all
ranks reach the final checkpoint together instead of some hanging in a collective.
"""
from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

from megarl.distributed import device


class StopSignal:
    def __init__(self, budget_min: float = 0.0):
        self.start = time.monotonic()
        self.budget_s = budget_min * 60.0
        self.signalled = False
        self.reason = ""
        signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, signum, frame):
        self.signalled = True

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
