"""The environment loop: every episode's environment runs here, off the rollout loop.

The rollout loop (rank 0's pool thread) must never wait on an environment: a slow or
CPU-bound one would stall every engine request. `EnvRunner` owns a thread with its own asyncio
loop; `await runner.call(env.step(turn), timeout_s)` from the rollout loop schedules the
coroutine there and waits for it without blocking. A call past its timeout is cancelled there
and raises `EnvTimeout` here; what the environment raises comes back as `EnvFailure`. Either
way the caller ends that episode with reward 0 and counts it: never the run.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Awaitable, Optional


class EnvFailure(RuntimeError):
    """The environment raised: the message names the episode and the error."""


class EnvTimeout(EnvFailure):
    """The environment did not answer within env.timeout_s."""


class EnvRunner:
    """A daemon thread running one asyncio loop for environments. Idempotent `close()`."""

    def __init__(self, name: str = "megarl-env"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def call(self, coro: Awaitable, timeout_s: Optional[float], what: str = "environment"):
        """Run `coro` on the environment loop; await its result from another loop."""
        async def bounded():
            return await asyncio.wait_for(coro, timeout_s) if timeout_s else await coro
        fut = asyncio.run_coroutine_threadsafe(bounded(), self.loop)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.TimeoutError as err:
            raise EnvTimeout(f"{what}: no answer within env.timeout_s={timeout_s}") from err
        except asyncio.CancelledError:
            fut.cancel()
            raise
        except Exception as err:   # noqa: BLE001 - the environment's own error, whatever it is
            raise EnvFailure(f"{what}: {type(err).__name__}: {err}") from err

    def run(self, coro: Awaitable, timeout_s: Optional[float] = None):
        """Blocking form for synchronous callers (tests, replay outside a loop)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout_s)

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
        if not self.loop.is_running() and not self.loop.is_closed():
            self.loop.close()
