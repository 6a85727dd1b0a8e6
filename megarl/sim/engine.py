"""A simulated inference engine behind the real engine protocol (`megarl/rollout/engine.py`).

Continuous batching as vLLM does it: the engine runs one step at a time; every running
request gets one token per step; requests that arrive during a step join at the next one,
paying their prefill (prompt + already generated tokens: a continuation after a weight
update is re-prefilled, as the update resets the prefix cache) and a per-request overhead in
that step. A step's time is `costs.step_s(batch, context_tokens, prefill_tokens, new_requests)`.
Responses have no content: a request runs for its `max_tokens` (the workload forces every
sample's length through the controller's budgets) unless it is aborted; aborts resolve at
once with the tokens so far. `update_weights` costs `costs.load_weights_s`.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Optional, Protocol

from megarl.rollout.engine import Engine, EngineHealth, GenRequest, GenResult

TOKEN = 7   # every simulated token; only lengths matter


class EngineCosts(Protocol):
    load_weights_s: float

    def step_s(self, batch: int, context_tokens: int, prefill_tokens: int, new_requests: int) -> float:
        ...


@dataclass
class _Running:
    req: GenRequest
    result: GenResult
    context: int                       # prompt + tokens so far
    done: asyncio.Future
    prefilled: bool = False


@dataclass
class EngineLog:
    busy_s: float = 0.0                # time with at least one request in a step
    steps: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    requests: int = 0
    batch_area: float = 0.0            # integral of the running batch over time
    timeline: list = field(default_factory=list)   # (t, running) after each step, if recorded


class SimEngine(Engine):
    def __init__(self, name: str, costs: EngineCosts, record_timeline: bool = False):
        self.name, self.costs = name, costs
        self.version, self.paused = 0, False
        self.log = EngineLog()
        self.record_timeline = record_timeline
        self._running: dict[str, _Running] = {}
        self._wake: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.ensure_future(self._loop())

    @property
    def running(self) -> int:
        return len(self._running)

    async def generate(self, req: GenRequest) -> GenResult:
        if req.key in self._running:
            raise ValueError(f"request {req.key!r} is already running on {self.name}")
        run = _Running(req, GenResult(req.key, engine=self.name), len(req.prompt_ids),
                       asyncio.get_running_loop().create_future())
        self.log.requests += 1
        if req.max_tokens <= 0:
            run.result.finish_reason = "length"
            return run.result
        self._running[req.key] = run
        self._wake.set()
        return await run.done

    def _finish(self, run: _Running, reason: str) -> None:
        run.result.finish_reason = reason
        self._running.pop(run.req.key, None)
        if not run.done.done():
            run.done.set_result(run.result)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._running or self.paused:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = list(self._running.values())
            new = [r for r in batch if not r.prefilled]
            prefill = sum(r.context for r in new)
            context = sum(r.context for r in batch)
            dt = self.costs.step_s(len(batch), context, prefill, len(new))
            for r in new:
                r.prefilled = True
            await asyncio.sleep(dt)
            log = self.log
            log.busy_s += dt
            log.steps += 1
            log.prefill_tokens += prefill
            log.batch_area += dt * len(batch)
            for r in batch:
                if r.req.key not in self._running:   # aborted during the step: no token
                    continue
                r.result.extend([TOKEN], [-1.0], self.version)
                r.context += 1
                log.tokens += 1
                if len(r.result.token_ids) >= r.req.max_tokens:
                    self._finish(r, "length")
            if self.record_timeline:
                log.timeline.append((loop.time(), len(self._running)))

    async def abort(self, keys=None) -> None:
        targets = list(self._running) if keys is None else [k for k in keys if k in self._running]
        for k in targets:
            self._finish(self._running[k], "abort")

    async def pause(self) -> None:
        self.paused = True

    async def resume(self) -> None:
        self.paused = False
        self._wake.set()

    async def update_weights(self, path: str, version: int) -> None:
        if not self.paused or self._running:
            raise RuntimeError(f"{self.name}: update_weights needs a paused engine with nothing running")
        await asyncio.sleep(self.costs.load_weights_s)
        self.log.busy_s += self.costs.load_weights_s
        self.version = version

    async def health(self) -> EngineHealth:
        return EngineHealth(self.name, True, self.paused, self.running, self.version)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
