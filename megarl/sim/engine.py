"""A simulated inference engine behind the real engine protocol (`megarl/rollout/engine.py`).

Continuous batching as vLLM does it: the engine runs one step at a time; every running
request gets one token per step; requests that arrive during a step join at the next one,
paying their prefill (prompt + already generated tokens: a continuation after a weight
update is re-prefilled, as the update resets the prefix cache) and a per-request overhead in
that step. A step's time is `costs.step_s(batch, context_tokens, prefill_tokens, new_requests)`.
Responses have no content: a request runs for its `max_tokens` (the workload forces every
sample's length through the controller's budgets) unless it is aborted; aborts resolve at
once with the tokens so far (no simulated time passes). `reload_weights` costs `costs.load_weights_s`.
"""
from __future__ import annotations

import asyncio
import heapq
from dataclasses import dataclass, field
from typing import Optional, Protocol

from megarl.rollout.engine import Engine, EngineError, EngineHealth, GenRequest, GenResult

TOKEN = 7   # every simulated token; only lengths matter


class EngineCosts(Protocol):
    load_weights_s: float

    def step_s(self, batch: int, context_tokens: int, prefill_tokens: int, new_requests: int) -> float:
        ...


@dataclass
class _Running:
    req: GenRequest
    done: asyncio.Future
    prompt: int                        # prompt tokens (incl. a continuation's partial response)
    joined: int = -1                   # engine step count when its first step started (-1: waiting)


@dataclass
class EngineLog:
    busy_s: float = 0.0                # time spent in steps and weight loads
    steps: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    requests: int = 0
    batch_area: float = 0.0            # integral of the running batch over time
    timeline: list = field(default_factory=list)   # (t, running) after each step, if recorded


class SimEngine(Engine):
    """Cost per step O(requests that start or end in it): a running request's token count is
    the number of steps since it joined, and the weight version cannot change while it runs
    (updates need an idle, paused engine), so its result is built once, when it ends."""

    def __init__(self, name: str, costs: EngineCosts, record_timeline: bool = False):
        self.name, self.costs = name, costs
        self.version, self.paused = 0, False
        self.log = EngineLog()
        self.record_timeline = record_timeline
        self._running: dict[str, _Running] = {}
        self._ends: list[tuple[int, int, _Running]] = []   # heap: (step it ends after, tie, run)
        self._tie = 0
        self._step = 0                                 # steps completed
        self._context = 0                              # sum over joined requests of prompt - joined
        self._joined = 0
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
        self.log.requests += 1
        if req.max_tokens <= 0:
            return GenResult(req.key, finish_reason="length", engine=self.name)
        run = _Running(req, asyncio.get_running_loop().create_future(), len(req.prompt_ids))
        self._running[req.key] = run
        self._wake.set()
        return await run.done

    def _finish(self, run: _Running, reason: str) -> None:
        count = 0
        if run.joined >= 0:
            count = self._step - run.joined
            self._context -= run.prompt - run.joined
            self._joined -= 1
        self._running.pop(run.req.key, None)
        res = GenResult(run.req.key, [TOKEN] * count, [-1.0] * count, [self.version] * count,
                        reason, self.name)
        if not run.done.done():
            run.done.set_result(res)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._running or self.paused:
                self._wake.clear()
                await self._wake.wait()
                continue
            new = [r for r in self._running.values() if r.joined < 0]
            prefill = 0
            for r in new:   # join at this step: prefill, and end after max_tokens steps
                r.joined = self._step
                prefill += r.prompt
                self._context += r.prompt - r.joined
                self._joined += 1
                heapq.heappush(self._ends, (self._step + r.req.max_tokens, self._tie, r))
                self._tie += 1
            batch = self._joined
            context = self._context + batch * self._step
            dt = self.costs.step_s(batch, context, prefill, len(new))
            await asyncio.sleep(dt)
            self._step += 1
            log = self.log
            log.busy_s += dt
            log.steps += 1
            log.prefill_tokens += prefill
            log.batch_area += dt * batch
            log.tokens += self._joined         # requests aborted during the step got no token
            while self._ends and self._ends[0][0] <= self._step:
                _, _, run = heapq.heappop(self._ends)
                # an aborted run's entry stays behind; its key may be running again as a new run
                if self._running.get(run.req.key) is run:
                    self._finish(run, "length")
            if self.record_timeline:
                log.timeline.append((loop.time(), len(self._running)))

    async def abort(self, keys=None) -> None:
        targets = list(self._running) if keys is None else [k for k in keys if k in self._running]
        for k in targets:
            self._finish(self._running[k], "abort")
        if targets:
            await asyncio.sleep(0)   # their generate() calls resolve before abort returns (the protocol)

    async def pause(self) -> None:
        self.paused = True

    async def resume(self) -> None:
        self.paused = False
        self._wake.set()

    async def reload_weights(self, path: str, version: int) -> None:
        if not self.paused or self._running:
            raise EngineError(f"{self.name}: reload_weights needs a paused engine with nothing running")
        await asyncio.sleep(self.costs.load_weights_s)
        self.log.busy_s += self.costs.load_weights_s
        self.version = version

    async def health(self) -> EngineHealth:
        return EngineHealth(self.name, True, self.paused, self.running, self.version)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
