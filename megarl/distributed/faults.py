"""Fault injection for reliability tests: kill this process at a named point.

`MEGARL_FAULT=point@N[,point@N...]` makes the N-th arrival (1-based) of this process at
`faults.point("point")` send itself SIGKILL: no handler, no flush, no cleanup, what a node
loss or the OOM killer does. `MEGARL_FAULT_RANK=R` limits it to global rank R (default: every
rank). Unset, `point()` is a dictionary lookup. Points in the code:

| point | where |
| --- | --- |
| `rollout_result` | the controller absorbed one engine result (a round is in flight) |
| `update` | before an optimizer step (actor or critic) |
| `sync_bucket` | a weight-sync bucket was staged, before the engines load |
| `save` | a checkpoint's models were written, before COMPLETE and the rename |
| `step_end` | a step was logged, before any checkpoint of it |

`engine_fail@N` is not a kill: the engine pool's N-th request fails its engine as if the
engine had died at that moment (`faults.hit`); the pool retires it and the request goes on
elsewhere, which is the engine-failure path without a real process to kill.
"""
from __future__ import annotations

import os
import signal

_plan: dict[str, int] | None = None
_seen: dict[str, int] = {}


def _parse(spec: str) -> dict[str, int]:
    plan = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, count = item.partition("@")
        try:
            plan[name] = int(count or 1)
        except ValueError:
            raise ValueError(f"MEGARL_FAULT={spec!r}: expected point@N[,point@N], e.g. update@3") from None
    return plan


def _active() -> dict[str, int]:
    global _plan
    if _plan is None:
        rank = os.environ.get("MEGARL_FAULT_RANK")
        mine = rank is None or rank == os.environ.get("RANK", "0")
        _plan = _parse(os.environ.get("MEGARL_FAULT", "")) if mine else {}
    return _plan


def hit(name: str) -> bool:
    """Count an arrival at `name`; True on the arrival the plan names."""
    plan = _active()
    if name not in plan:
        return False
    _seen[name] = _seen.get(name, 0) + 1
    return _seen[name] == plan[name]


def point(name: str) -> None:
    """Count an arrival at `name`; SIGKILL this process if the plan says so."""
    if hit(name):
        os.kill(os.getpid(), signal.SIGKILL)


def reset() -> None:
    """Forget the plan and the counts (tests that change MEGARL_FAULT in one process)."""
    global _plan
    _plan = None
    _seen.clear()
