"""An asyncio event loop on a virtual clock.

The loop's `time()` is a counter. When nothing is ready to run, asyncio asks its selector to
wait until the next timer; this selector advances the counter to that timer instead of
waiting, so `await asyncio.sleep(dt)` costs no wall time and every run is reproducible. Any
asyncio code (the controller, the engine pool) runs on it unchanged, as long as it does no
real I/O and starts no threads.
"""
from __future__ import annotations

import asyncio
import selectors


class SimulationDeadlock(RuntimeError):
    """Nothing is ready and no timer is pending: the simulated system waits forever."""


class _VirtualSelector(selectors.SelectSelector):
    def __init__(self):
        super().__init__()
        self.loop: "VirtualClockLoop | None" = None

    def select(self, timeout=None):
        if timeout is None:
            raise SimulationDeadlock("the simulation has nothing to run and no timer pending "
                                     "(a coroutine waits for an event nobody will set)")
        if timeout > 0:
            self.loop.advance(timeout)
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = 0.0):
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self._now = start

    def time(self) -> float:
        return self._now

    def advance(self, dt: float) -> None:
        self._now += dt


def run(coro, start: float = 0.0):
    """Run `coro` to completion on a fresh virtual-clock loop; returns its result."""
    loop = VirtualClockLoop(start)
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()
