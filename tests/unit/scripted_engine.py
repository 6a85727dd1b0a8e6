"""A scripted engine implementing the engine protocol, on a deterministic clock (unit tests only).

Prompts look like [gid, index, L, *tokens so far]: the sample's full response has L tokens,
token p of it is 1000 + p with behaviour logprob -0.001 * (p + 1), so any token lost,
duplicated or misplaced across aborts and continuations shows. All engines share one `Clock`:
every running request gets one token per tick, and a tick only happens after the event loop
has settled (no wall time involved), so runs are reproducible on any machine.
"""
from __future__ import annotations

import asyncio

from megarl.rollout.engine import Engine, EngineError, EngineHealth, GenResult, copy_result

TOKEN0 = 1000


def behaviour_logprob(position: int) -> float:
    return -0.001 * (position + 1)


class Clock:
    """Ticks after `settle` event-loop iterations with nothing scheduled in between."""

    def __init__(self, settle: int = 30):
        self.settle, self.ticks = settle, 0
        self._cond = asyncio.Condition()
        self._task = None
        self.running_total = []          # requests running across all engines, at each tick
        self.pending = []                # whether the scheduler had work pending, at each tick
        self.is_pending = lambda: True
        self.engines: list["ScriptedEngine"] = []

    def start(self):
        self._task = asyncio.ensure_future(self._run())

    async def _run(self):
        while True:
            for _ in range(self.settle):
                await asyncio.sleep(0)
            self.running_total.append(sum(e.running for e in self.engines))
            self.pending.append(self.is_pending())
            async with self._cond:
                self.ticks += 1
                self._cond.notify_all()

    async def tick(self):
        async with self._cond:
            await self._cond.wait()

    def stop(self):
        if self._task:
            self._task.cancel()


class ScriptedEngine(Engine):
    def __init__(self, name: str, clock: Clock):
        self.name, self.clock = name, clock
        self.version, self.paused = 0, False
        self._running: dict[str, asyncio.Future] = {}
        self._abort: set[str] = set()
        self._results: dict[str, GenResult] = {}
        self.served = 0
        self.kv_cleared = 0              # held requests whose KV clear_kv() dropped
        clock.engines.append(self)

    async def start(self):
        pass

    @property
    def running(self):
        return len(self._running)

    async def generate(self, req):
        gid, index, length, *done = req.prompt_ids
        res = GenResult(req.key, engine=self.name)
        fut = asyncio.get_running_loop().create_future()
        self._running[req.key] = fut
        self._results[req.key] = res
        self.served += 1
        try:
            for _ in range(req.max_tokens):
                if len(done) + len(res.token_ids) >= length:
                    res.finish_reason = "stop"
                    return res
                await self.clock.tick()
                while self.paused and req.key not in self._abort:
                    await self.clock.tick()
                if req.key in self._abort:
                    res.finish_reason = "abort"
                    return res
                p = len(done) + len(res.token_ids)
                res.extend([TOKEN0 + p], [behaviour_logprob(p)], self.version)
            res.finish_reason = "stop" if len(done) + len(res.token_ids) >= length else "length"
            return res
        finally:
            del self._running[req.key]
            del self._results[req.key]
            self._abort.discard(req.key)
            fut.set_result(None)

    async def abort(self, keys=None):
        keys = list(self._running) if keys is None else [k for k in keys if k in self._running]
        self._abort.update(keys)
        futs = [self._running[k] for k in keys]
        if futs:
            await asyncio.gather(*futs)

    async def pause(self):
        self.paused = True

    async def resume(self):
        self.paused = False

    def partial(self, key):
        res = self._results.get(key)
        return None if res is None else copy_result(res)

    async def clear_kv(self):
        self.kv_cleared += len(self._running)

    async def reload_weights(self, path, version):
        if not self.paused:   # the protocol's rule (megarl/rollout/engine.py); held requests may stay
            raise EngineError(f"engine {self.name}: a weight update needs the engine paused")
        self.version = version

    async def health(self):
        return EngineHealth(self.name, True, self.paused, self.running, self.version)

    async def close(self):
        pass
