"""A simulated inference engine behind the real engine protocol (`megarl/rollout/engines/engine.py`).

Continuous batching as vLLM does it: the engine runs one step at a time; every running
request gets one token per step; requests that arrive during a step join at the next one,
paying their prefill (prompt + already generated tokens: a continuation after a weight
update is re-prefilled, as the update resets the prefix cache) and a per-request overhead in
that step. A step's time is `costs.step_s(batch, context_tokens, prefill_tokens, new_requests)`.
Responses have no content: a request runs for its `max_tokens` (the workload forces every
sample's length through the controller's budgets) unless it is aborted; aborts resolve at
once with the tokens so far (no simulated time passes). `reload_weights` costs `costs.load_weights_s`.

Keep-mode updates (rollout.update_mode=keep): `pause()` with requests running waits for the
step in flight (its tokens arrive, then nothing more until `resume()`), weights may load into
the paused engine while it holds requests, and a held request's later tokens carry the new
version. `clear_kv()` (rollout.keep_kv=false) drops the held requests' KV: each one's context
(prompt + tokens so far) is prefilled again in the step where it next runs; without it nothing
is recomputed. `partial(key)` is what a request in flight has produced so far.
"""
from __future__ import annotations

import asyncio
import heapq
from dataclasses import dataclass, field
from typing import Optional, Protocol

from megarl.rollout.engines.engine import Engine, EngineError, EngineHealth, GenRequest, GenResult

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
    # (tokens produced before, version) at each version change: [(0, v0)] from its join on, one
    # more per weight update it is held over (keep mode); a token's version is that of the last
    # entry at or below its index
    spans: list = field(default_factory=list)


@dataclass
class EngineLog:
    busy_s: float = 0.0                # time spent in steps and weight loads
    steps: int = 0
    tokens: int = 0
    prefill_tokens: int = 0            # every prefilled token, the re-prefilled ones included
    reprefill_tokens: int = 0          # of those: held requests' context recomputed after clear_kv()
    reprefill_response_tokens: int = 0  # of those: the generated part (what the controller's reprefill_tokens counts)
    requests: int = 0
    # results (resolved requests) whose tokens came from more than one weight version (a
    # request held over an update), and their tokens
    multi_version_requests: int = 0
    multi_version_tokens: int = 0
    batch_area: float = 0.0            # integral of the running batch over time
    timeline: list = field(default_factory=list)   # (t, running) after each step, if recorded


class SimEngine(Engine):
    """Cost per step O(requests that start or end in it): a running request's token count is
    the number of steps since it joined, and its versions change only at a weight update (the
    engine is paused then), so its result is built once, when it ends (or `partial` asks).
    What is O(requests held) happens once per update, not per step: `reload_weights` notes the
    new version on each held request, `clear_kv` queues each for its re-prefill."""

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
        self._recompute: list[_Running] = []           # held runs whose KV clear_kv() dropped
        self._stepping: Optional[asyncio.Future] = None   # the step in flight; done when it ended
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

    def _result(self, run: _Running, reason: str) -> GenResult:
        """What `run` has produced so far, each token with the version that produced it."""
        count = self._step - run.joined if run.joined >= 0 else 0
        versions: list[int] = []
        for i, (start, version) in enumerate(run.spans):
            end = run.spans[i + 1][0] if i + 1 < len(run.spans) else count
            versions += [version] * (min(end, count) - start)
        return GenResult(run.req.key, [TOKEN] * count, [-1.0] * count, versions, reason, self.name)

    def partial(self, key: str) -> Optional[GenResult]:
        run = self._running.get(key)
        return None if run is None else self._result(run, "abort")

    def _finish(self, run: _Running, reason: str) -> None:
        res = self._result(run, reason)
        if run.joined >= 0:
            self._context -= run.prompt - run.joined
            self._joined -= 1
        self._running.pop(run.req.key, None)
        if len(set(res.versions)) > 1:
            self.log.multi_version_requests += 1
            self.log.multi_version_tokens += len(res.versions)
        if not run.done.done():
            run.done.set_result(res)

    def _admit(self) -> tuple[int, int]:
        """The requests that join at this step and the held ones whose KV was dropped:
        (prefill tokens, new requests), logged as the step starts (a step cut short by the
        simulation's end prefilled them too)."""
        new = [r for r in self._running.values() if r.joined < 0]
        prefill = 0
        for r in new:   # join at this step: prefill, and end after max_tokens steps
            r.joined = self._step
            r.spans = [(0, self.version)]
            prefill += r.prompt
            self.log.prefill_tokens += r.prompt
            self._context += r.prompt - r.joined
            self._joined += 1
            heapq.heappush(self._ends, (self._step + r.req.max_tokens, self._tie, r))
            self._tie += 1
        recompute, self._recompute = self._recompute, []
        for r in recompute:   # clear_kv(): prompt + tokens so far, computed again (still running only)
            if self._running.get(r.req.key) is r:
                tokens = r.prompt + self._step - r.joined
                prefill += tokens
                self.log.prefill_tokens += tokens
                self.log.reprefill_tokens += tokens
                self.log.reprefill_response_tokens += self._step - r.joined
        return prefill, len(new)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._running or self.paused:
                self._wake.clear()
                await self._wake.wait()
                continue
            prefill, new = self._admit()
            batch = self._joined
            context = self._context + batch * self._step
            dt = self.costs.step_s(batch, context, prefill, new)
            self._stepping = loop.create_future()
            try:
                await asyncio.sleep(dt)
                self._step += 1
                log = self.log
                log.busy_s += dt
                log.steps += 1
                log.batch_area += dt * batch
                log.tokens += self._joined         # requests aborted during the step got no token
                while self._ends and self._ends[0][0] <= self._step:
                    _, _, run = heapq.heappop(self._ends)
                    # an aborted run's entry stays behind; its key may be running again as a new run
                    if self._running.get(run.req.key) is run:
                        self._finish(run, "length")
                if self.record_timeline:
                    log.timeline.append((loop.time(), len(self._running)))
            finally:
                self._stepping.set_result(None)

    async def abort(self, keys=None) -> None:
        targets = list(self._running) if keys is None else [k for k in keys if k in self._running]
        for k in targets:
            self._finish(self._running[k], "abort")
        if targets:
            await asyncio.sleep(0)   # their generate() calls resolve before abort returns (the protocol)

    async def pause(self) -> None:
        """Stop scheduling. With requests running, return once the step in flight has ended:
        its tokens are theirs, and nothing more arrives before resume() (the protocol). With
        none (the pool aborted them first, abort mode), at once: the step in flight serves
        nobody and the weight load may overlap it."""
        self.paused = True
        if self._joined and self._stepping is not None and not self._stepping.done():
            await asyncio.shield(self._stepping)

    async def resume(self) -> None:
        self.paused = False
        self._wake.set()

    def _held(self) -> list[_Running]:
        return [r for r in self._running.values() if r.joined >= 0]

    async def reload_weights(self, path: str, version: int) -> None:
        if not self.paused:
            raise EngineError(f"{self.name}: reload_weights needs a paused engine (pause() first)")
        await asyncio.sleep(self.costs.load_weights_s)
        self.log.busy_s += self.costs.load_weights_s
        self.version = version
        for r in self._held():   # held over the update: its next token is the new version's
            count = self._step - r.joined
            if r.spans[-1][0] == count:
                r.spans[-1] = (count, version)   # no token under the version it replaces
            else:
                r.spans.append((count, version))

    async def clear_kv(self) -> None:
        if not self.paused:
            raise EngineError(f"{self.name}: clear_kv needs a paused engine (it runs inside a weight update)")
        queued = {id(r) for r in self._recompute}
        self._recompute += [r for r in self._held() if id(r) not in queued]

    async def health(self) -> EngineHealth:
        return EngineHealth(self.name, True, self.paused, self.running, self.version)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
