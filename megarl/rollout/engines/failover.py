"""Engine faults in the pool: which failure retires an engine, which answer earns a request one
more try on the same engine, and the replacement started in a retired engine's place.

An engine whose request fails (it died, hung past rollout.engines.timeout_s,
or answered garbage) is retired: it leaves the pool, the event is logged and counted
(`failures`), and the request continues on the least-loaded remaining engine from the tokens
the failed engine had streamed (their versions kept). So do the retired engine's other
requests, which resolve as aborted when it is closed, and any request an engine ends as
aborted without the pool having asked (such an engine is retired too): a sample is returned
cut off only by an abort the pool was asked for (`abort`, a weight update with
rollout.update_mode=abort) or when its caller gave up. A request the engine refuses as invalid
(`RequestError`: its prompt is too long, ...) is the request's error: it goes back to the
caller as is, no engine is retired and nothing is retried. An engine that answers it failed a
request (`ServerError`: a server's HTTP 5xx) is up and said so: when its health check answers
too, the request goes to it once more from the tokens it had streamed (`retries`), and only a
second such answer for the same request, or a failed health check, retires it; one 500 never
costs the run a healthy engine. The pool gives up, with the last
engine's error, only when no engine is left or after `failures_max` retirements. A retired
engine takes no more requests or weights. With a `replace` factory (rollout.engines.restart),
a fresh engine is started in its place in the background; it joins at the next weight update,
after loading that version, so it never serves weights other than the pool's.

`Failover` is a part of `EnginePool` (pool.py), split out by concept: it works on the pool's
engines, its request book (`_where`, `_aborted`) and its replacement slots, on the pool's
event loop; `EnginePool._serve` continues a request on another engine with what it returns.
"""
from __future__ import annotations

import asyncio
import logging
import time

from megarl.rollout.engines.engine import Engine, EngineError, GenResult, ServerError

log = logging.getLogger("megarl.engines")


class Failover:
    """Retiring, retrying and replacing engines (a base of the pool)."""

    async def _answers(self, engine: Engine, key: str, err: EngineError) -> bool:
        """`err` is an answer (ServerError) from an engine still in the pool whose health check
        answers too: it is up, and the request may go to it once more (module docstring)."""
        if not isinstance(err, ServerError) or engine not in self.engines or self._shutting:
            return False
        try:
            alive = (await asyncio.wait_for(engine.health(), self.timeout_s)).alive
        except (EngineError, asyncio.TimeoutError):
            alive = False
        if not alive or engine not in self.engines:    # (retired meanwhile through another request)
            return False
        self.retries += 1
        log.warning("megarl: engine %s answered request %s with a server error and answers its health check: "
                    "the request goes to it once more (a second such answer retires it): %s", engine.name, key, err)
        return True

    def _cut_short(self, key: str, result: GenResult) -> bool:
        """`result` ended as aborted though nobody asked: its engine was retired and closed (its
        requests resolve as aborted then), or it aborted on its own. Not so when the pool
        aborted it (abort(), a weight update's abort), the pool is closing, or the caller gave
        up (a cancelled generate(): the engine resolved it with its partial)."""
        if result.finish_reason != "abort" or key in self._aborted or self._shutting:
            return False
        task = asyncio.current_task()
        return not (task is not None and task.cancelling())

    def _retire(self, engine: Engine, err: EngineError) -> None:
        """Take a failed engine out of service; raise once none is left or too many failed."""
        if engine in self.engines:
            self.engines.remove(engine)
            self.retired.append(engine)
            self.failures.append({"t": time.time(), "engine": engine.name, "error": str(err)})
            log.warning("megarl: engine %s failed and was retired (%d left, %d of at most %d failures): %s",
                        engine.name, len(self.engines), len(self.failures), self.failures_max, err)
            # stop its process; nothing waits on it, but the task is kept so it is not collected
            closing = asyncio.ensure_future(engine.close())
            self._closing.append(closing)
            if self.replace is not None and len(self.failures) <= self.failures_max:
                self._starting.append(asyncio.ensure_future(self._start_replacement(engine, closing)))
        if not self.engines:
            raise EngineError(f"no rollout engine left: {err}") from err
        if len(self.failures) > self.failures_max:
            raise EngineError(f"{len(self.failures)} engine failures (rollout.engines.failures_max="
                              f"{self.failures_max}); the last: {err}") from err

    async def retire(self, engine: Engine, err: EngineError) -> None:
        """Take `engine` out of service from outside the pool's own calls (a transport that saw
        it fail); raises as `_retire` does when none is left or too many failed."""
        self._retire(engine, err)

    async def _start_replacement(self, failed: Engine, closing: asyncio.Future) -> None:
        """Start a fresh engine in place of `failed` (after its process is gone: the
        replacement may need the same port, GPU or memory); it joins at the next update."""
        await asyncio.gather(closing, return_exceptions=True)
        slot = self._slot[id(failed)]
        fresh = self.replace(slot)
        self._slot[id(fresh)] = slot
        try:
            await fresh.start()
        except Exception as err:   # noqa: BLE001 - logged; the pool goes on without it
            log.warning("megarl: engine %s could not be restarted: %s", failed.name, err)
            await asyncio.gather(fresh.close(), return_exceptions=True)
            return
        log.warning("megarl: engine %s restarted; it joins at the next weight update", fresh.name)
        self.joining.append(fresh)
