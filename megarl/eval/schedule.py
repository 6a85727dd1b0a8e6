"""When the evaluation runs: a pure function of the weight version, so a resumed run keeps it.

Version v is the actor after v training steps (what the engines hold while step v generates).
It is evaluated when v == 0 (eval.at_start), when eval.every divides v, and at v == train.steps
(the run's end). Nothing about the schedule is kept in a checkpoint: a run resumed at step s
evaluates exactly the versions an uninterrupted run evaluates from s on (metrics.jsonl keeps
the rows before s, megarl/metrics/logger.py, so none is written twice).
"""
from __future__ import annotations


def due(version: int, every: int, steps: int, at_start: bool = True) -> bool:
    """Is version `version` evaluated (see the module docstring)?"""
    if version == 0:
        return at_start
    return version == steps or (every > 0 and version % every == 0)


def planned(start: int, steps: int, every: int, at_start: bool = True) -> list[int]:
    """Every version a run from step `start` to train.steps evaluates, in order."""
    return [v for v in range(start, steps + 1) if due(v, every, steps, at_start)]
