"""A scripted engine implementing the engine protocol, on a deterministic clock (unit tests only).

Prompts look like [gid, index, L, *tokens so far]: the sample's full response has L tokens,
token p of it is 1000 + p with behaviour logprob -0.001 * (p + 1), so any token lost,
duplicated or misplaced across aborts and continuations shows. All engines share one `Clock`:
every running request gets one token per tick, and a tick only happens after the event loop
has settled (no wall time involved), so runs are reproducible on any machine.

Faults, as real engines show them: `stall_after=k` makes every request stop after k tokens
(the engine hangs); the first one silent for `timeout_ticks` ticks raises EngineError with its
tokens (the engine's own timeout), the others wait. `close()` resolves every running request
as aborted with its tokens so far, as a closed vLLM engine (in-process or a server) does.
`refuse(req)` -> a message makes the engine refuse that request as invalid (RequestError), as
vLLM refuses a prompt longer than its max_model_len.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, Callable, Optional

from megarl.rollout.engines.engine import Engine, EngineError, EngineHealth, GenResult, RequestError, copy_result

TOKEN0 = 1000


def behaviour_logprob(position: int) -> float:
    return -0.001 * (position + 1)


def assert_whole(tokens: list[int], logprobs: list[float], reason: str, length: int) -> None:
    """A sample of `length` tokens came out whole: stopped, every token and its behaviour
    logprob in place (none lost, duplicated or misplaced across failovers and retries)."""
    assert reason == "stop", f"a sample ended {reason!r} with {len(tokens)} tokens"
    assert tokens == [TOKEN0 + p for p in range(length)]
    assert logprobs == [behaviour_logprob(p) for p in range(length)]


def run_on_clock(main: Callable[["Clock"], Awaitable]):
    """asyncio.run(main(clock)) with a started `Clock`, stopped however `main` ends."""
    async def wrapped():
        clock = Clock()
        clock.start()
        try:
            return await main(clock)
        finally:
            clock.stop()
    return asyncio.run(wrapped())


class Clock:
    """Ticks after `settle` event-loop iterations with nothing scheduled in between."""

    def __init__(self, settle: int = 30):
        self.settle, self.ticks = settle, 0
        self.held = 0                    # holding() blocks in flight: no tick meanwhile
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
            while self.held:
                await asyncio.sleep(0.001)
            for _ in range(self.settle):
                await asyncio.sleep(0)
            self.running_total.append(sum(e.running for e in self.engines))
            self.pending.append(self.is_pending())
            async with self._cond:
                self.ticks += 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def holding(self):
        """No tick while the block runs: work off this loop (an environment on its own thread)
        costs no tokens however long it takes in wall time on a loaded machine."""
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1

    async def tick(self):
        async with self._cond:
            await self._cond.wait()

    def stop(self):
        if self._task:
            self._task.cancel()


class ScriptedEngine(Engine):
    def __init__(self, name: str, clock: Clock, stall_after: Optional[int] = None, timeout_ticks: int = 10,
                 refuse: Optional[Callable] = None):
        self.name, self.clock = name, clock
        self.stall_after, self.timeout_ticks, self.timed_out = stall_after, timeout_ticks, False
        self.refuse = refuse or (lambda req: None)
        self.closed = False
        self.refused = 0                 # requests refused as invalid
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
        if self.closed:
            raise EngineError(f"engine {self.name} is closed")
        why = self.refuse(req)
        if why:
            self.refused += 1
            raise RequestError(f"engine {self.name} refused request {req.key}: {why}", req.key)
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
                if self.stall_after is not None and len(res.token_ids) >= self.stall_after:
                    await self._hang(req, res)
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

    async def _hang(self, req, res: GenResult) -> None:
        """No token any more: the first request silent for timeout_ticks raises (with its
        tokens), the others wait until aborted (or the engine is closed)."""
        silent = 0
        while req.key not in self._abort:
            await self.clock.tick()
            silent += 1
            if silent >= self.timeout_ticks and not self.timed_out:
                self.timed_out = True
                raise EngineError(f"engine {self.name}: request {req.key} produced no token for {silent} ticks",
                                  partial=copy_result(res))
        res.finish_reason = "abort"

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
        if not self.paused:   # the protocol's rule (megarl/rollout/engines/engine.py); held requests may stay
            raise EngineError(f"engine {self.name}: a weight update needs the engine paused")
        self.version = version

    async def health(self):
        return EngineHealth(self.name, True, self.paused, self.running, self.version)

    async def close(self):
        self.closed = True
        await self.abort(None)
