"""The engines' side of a push's end, on trainer rank 0: the wait for staged versions to be
ready, then the pause that holds the swap (collective.py and sharded.py share both).

`await_prepared`: a staged push's buckets are queued beside each engine's model, to be loaded
into a shadow of it (rollout/weights/shadow.py). Pausing at once would hold that load in the
pause, so rank 0 polls every engine (`Engine.staged_ready`, a worker method: engines/
staged_swap.py), each poll loading a slice on the engine's thread between its model steps, and
pauses when each is ready. `Pause`: the pause itself, timed (`sync_paused_s`).
"""
from __future__ import annotations

import asyncio
import time

from megarl.rollout.engines.engine import Engine

#: between two polls of the engines' staged versions
PREPARED_POLL_S = 0.01


async def settled(coros) -> list:
    """Every coroutine's result, or the exception it raised (the caller names the engine)."""
    return await asyncio.gather(*coros, return_exceptions=True)


def await_prepared(sp, engines: list[Engine]) -> None:
    """Poll until every engine's staged version is ready. Bounded by rollout.engines.timeout_s;
    an engine that does not answer, or answers with an error, is left to the swap (which waits
    for it, paused, or fails it)."""
    pending, deadline = list(engines), time.monotonic() + float(sp.pool.timeout_s)
    while pending and time.monotonic() < deadline:
        answers = sp.call(settled([e.staged_ready() for e in pending]),
                          "asking the engines whether the staged weights are ready")
        pending = [e for e, ready in zip(pending, answers) if ready is False]
        if pending:
            time.sleep(PREPARED_POLL_S)


class Pause:
    """A push's pause of every engine (rank 0): `begin` at most once (pool.begin_update: held
    or aborted requests, paused engines), `end` always (the engines resume, also after a
    failure); `seconds` from the start of the one to the end of the other: sync_paused_s."""

    def __init__(self, sp):
        self.sp = sp
        self.since: float | None = None
        self.seconds = 0.0

    def begin(self, admit: bool) -> list[Engine]:
        if self.since is not None:       # a redone session's swap: paused already
            return list(self.sp.pool.engines)
        self.since = time.perf_counter()
        return self.sp.call(self.sp.pool.begin_update(admit=admit), "pausing the engines for a weight update")

    def end(self) -> None:
        if self.since is None:
            return
        try:
            self.sp.call(self.sp.pool.end_update(), "resuming the engines")
        finally:
            self.seconds, self.since = time.perf_counter() - self.since, None
