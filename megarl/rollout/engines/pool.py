"""The engine pool: N engines behind the engine protocol, and the event loop that drives them.

The trainer is synchronous (SPMD ranks stepping together); engines are asyncio. Rank 0 runs
one event loop in a background thread (`LoopThread`) and the pool's coroutines on it; the
driver calls them through `pool.call(...)`, which blocks with a deadline so a step never hangs
on an engine. The partial-rollout controller runs its own coroutines on the same loop.

Its parts: `update_sessions.py` (a weight update: every engine in one session),
`failover.py` (engine faults: retire, one more try, replace); this module spreads the
requests over the engines, continues a failed engine's request on another one, aborts,
and runs the loop thread and the synchronous driver's view (`SyncPool`).
"""
from __future__ import annotations

import asyncio
import itertools
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Awaitable, Callable, Optional, Sequence

from megarl.distributed import faults
from megarl.rollout import routes
from megarl.rollout.engines.build import build_engine, build_engines
from megarl.rollout.engines.engine import (
    Engine,
    EngineError,
    EngineHealth,
    GenRequest,
    GenResult,
    RequestError,
    copy_result,
)
from megarl.rollout.engines.failover import Failover
from megarl.rollout.engines.update_sessions import UpdateSessions


class LoopThread:
    """An asyncio event loop in a daemon thread; `run(coro, timeout)` from synchronous code."""

    def __init__(self, name: str = "megarl-engines"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable, timeout: Optional[float] = None, what: str = "engine call",
            setting: str = "rollout.engines.timeout_s"):
        return self.wait(self.submit(coro), timeout, what, setting)

    def submit(self, coro: Awaitable):
        """Start `coro` on the loop; returns a concurrent.futures.Future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def wait(self, future, timeout: Optional[float], what: str, setting: str = "rollout.engines.timeout_s"):
        """The future's result within `timeout`; past it an EngineError naming `setting`."""
        try:
            return future.result(timeout)
        except FutureTimeout:
            future.cancel()
            raise EngineError(f"{what} did not finish within {timeout:g} s "
                              f"({setting}): an engine is hung or slow; see its log, or raise {setting}") from None
        except BaseException:   # this thread was interrupted (a SIGTERM's Stopped): the call ends too
            future.cancel()
            raise

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        if not self.loop.is_running() and not self.loop.is_closed():
            self.loop.close()


class EnginePool(Failover, UpdateSessions):
    """Engines of one policy. Requests go to the least-loaded engine; versions move together."""

    def __init__(self, engines: Sequence[Engine], timeout_s: float, failures_max: int = 0,
                 replace: Optional[Callable[[int], Engine]] = None, update_mode: str = "abort",
                 keep_kv: bool = False):
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        if update_mode not in ("keep", "abort"):
            raise ValueError(f"rollout.update_mode={update_mode!r}: choose keep or abort")
        self.update_mode, self.keep_kv = update_mode, keep_kv   # rollout.update_mode / rollout.keep_kv
        self._served: dict[str, GenResult] = {}      # key -> tokens a failed engine served before
        self._prompt_len: dict[str, int] = {}        # key -> its prompt's tokens (routes' rows)
        self.engines = list(engines)             # the live ones: requests and weights go here
        self.retired: list[Engine] = []
        self.failures: list[dict] = []           # {"t", "engine", "error"} per retirement
        self.failures_max = failures_max
        self._closing: list[asyncio.Future] = []  # close() of retired engines, in flight
        self.timeout_s = timeout_s
        self._where: dict[str, Engine] = {}      # request key -> engine serving it
        # keys abort() was asked for: such a request is never (re)sent anywhere again, also when
        # its engine fails after the abort there returned (it resolves with what it has)
        self._aborted: set[str] = set()
        self._order = itertools.count()          # tie-break: round-robin among equally loaded
        self.holders: list = []                  # schedulers to hold around weight updates (async rounds)
        self.replace = replace                   # slot i -> an unstarted engine for it
        self._slot = {id(e): i for i, e in enumerate(self.engines)}   # engine -> its slot
        self.joining: list[Engine] = []          # replacements started, waiting for the next update
        self.restarts = 0                        # replacements that joined the pool
        self.retries = 0                         # requests sent again to an engine that answered 5xx
        self._starting: list[asyncio.Future] = []
        self._in_update: list[Engine] = []       # engines paused by the update in progress
        self._shutting = False                   # close() called: requests resolve with what they have

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every engine concurrently; on any failure close them all and raise."""
        results = await asyncio.gather(*(e.start() for e in self.engines), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            raise errors[0] if isinstance(errors[0], EngineError) else EngineError(str(errors[0]))

    async def close(self) -> None:
        self._shutting = True
        for t in self._starting:
            t.cancel()
        await asyncio.gather(*self._starting, return_exceptions=True)
        await asyncio.gather(*self._closing, *(e.close() for e in self.engines + self.joining),
                             return_exceptions=True)

    # -- requests ----------------------------------------------------------------------------
    def least_loaded(self) -> Engine:
        tick = next(self._order)
        n = len(self.engines)
        return min((self.engines[(tick + i) % n] for i in range(n)), key=lambda e: e.running)

    async def generate(self, req: GenRequest, engine: Optional[Engine] = None) -> GenResult:
        """Serve `req` on `engine` (default: the least-loaded one). If that engine fails, it is
        retired and the request continues on another one (see the module docstring)."""
        if req.key in self._where:
            raise ValueError(f"request key {req.key!r} is already in flight")
        engine = engine if engine in self.engines else (self.least_loaded() if self.engines else None)
        done = GenResult(req.key)                # tokens served before a failure
        self._served[req.key] = done
        self._prompt_len[req.key] = len(req.prompt_ids)
        try:
            return await self._serve(req, engine, done, req)
        finally:
            self._aborted.discard(req.key)
            self._served.pop(req.key, None)
            self._prompt_len.pop(req.key, None)

    def partial(self, key: str) -> Optional[GenResult]:
        """What the in-flight request `key` has so far (tokens a failed engine served, then what
        its engine streamed): a copy, None when it is not in flight."""
        done = self._served.get(key)
        if done is None:
            return None
        engine = self._where.get(key)
        out = copy_result(done)
        now = engine.partial(key) if engine is not None else None
        if now is not None:
            out.engine = engine.name
            _keep(out, now, self._prompt_len.get(key, 0))
        return out

    async def generate_all(self, requests: list[GenRequest]) -> list[GenResult]:
        """All requests concurrently, results in request order; the first failure raises."""
        return await _gather_or_raise([self.generate(r) for r in requests])

    async def generate_each(self, requests: list[GenRequest],
                            engine: Optional[Engine] = None) -> list[GenResult | RequestError]:
        """All requests concurrently (on `engine`, else each on the least-loaded one), in request
        order: each one's result, or the RequestError the engine refused it with (the request's
        own error: the caller answers it); the first other failure raises."""
        return await _gather_or_raise([self.generate(r, engine) for r in requests], keep=RequestError)

    def deadline_for(self, count: int) -> float:
        """A deadline for `count` requests served at once: each must make progress within
        rollout.engines.timeout_s, and an engine serves its share of them together."""
        return self.timeout_s * max(1, -(-count // max(1, len(self.engines))))

    async def _serve(self, req: GenRequest, engine: Optional[Engine], done: GenResult,
                     current: GenRequest) -> GenResult:
        retried = False                         # the request's one second try on an engine that answered
        while True:
            if req.key in self._aborted:        # aborted before it started, or between engines
                done.engine = engine.name if engine is not None else ""
                return done                     # finish_reason "abort", the tokens served so far
            if engine is None:                  # the run's last line: name the engine that went last
                last = f"; the last engine retired: {self.failures[-1]['error']}" if self.failures else ""
                raise EngineError(f"no rollout engine left for request {req.key}{last}")
            self._where[req.key] = engine
            again = False                       # this engine serves the request once more
            try:
                if faults.hit("engine_fail"):   # reliability tests: MEGARL_FAULT=engine_fail@N
                    raise EngineError(f"engine {engine.name}: failed on purpose (MEGARL_FAULT)")
                result = await engine.generate(current)
            except EngineError as err:
                _keep(done, err.partial, len(req.prompt_ids))
                again = not retried and await self._answers(engine, req.key, err)
                retried = retried or again
                if not again:
                    self._retire(engine, err)
            else:
                if not self._cut_short(req.key, result):
                    return _joined(done, result, engine, len(req.prompt_ids))
                # cut off, not by us: continued elsewhere from its tokens, never returned as final
                _keep(done, result, len(req.prompt_ids))
                if engine in self.engines:      # a live engine that aborts on its own is failing
                    self._retire(engine, EngineError(
                        f"engine {engine.name} ended request {req.key} as aborted after {len(result.token_ids)} "
                        f"tokens without an abort asked for"))
            finally:
                self._where.pop(req.key, None)
            if len(done.token_ids) >= req.max_tokens:
                done.finish_reason, done.engine = "length", engine.name
                return done
            if not again:
                engine = self.least_loaded() if self.engines else None   # none left: named at the loop's top
            current = GenRequest(req.key, req.prompt_ids + done.token_ids, req.max_tokens - len(done.token_ids),
                                 req.temperature, req.top_p, req.seed, req.ignore_eos, req.top_k)

    @property
    def running(self) -> int:
        return sum(e.running for e in self.engines)

    async def abort(self, keys: Optional[list[str]] = None) -> None:
        """Abort `keys` (None: everything on the engines); returns once each aborted request
        has resolved. A scheduler aborts only its own keys: probes and other schedulers sharing
        the engines keep running. A key not started yet, or failing over to another engine
        after this abort, is not sent again (it resolves as aborted with its tokens so far)."""
        # (each key leaves the set when its generate() returns; one never generated stays)
        self._aborted.update(self._where if keys is None else keys)
        if keys is None:
            await self._on_each(lambda e: e.abort(None))
            return
        by_engine: dict[int, list[str]] = {}
        for k in keys:
            if k in self._where:
                by_engine.setdefault(id(self._where[k]), []).append(k)
        await self._on_each(lambda e: e.abort(by_engine[id(e)]), [e for e in self.engines if id(e) in by_engine])

    async def _on_each(self, fn, engines: Optional[list[Engine]] = None) -> None:
        """fn(engine) on every live engine concurrently; an engine that fails is retired (which
        raises when none is left or too many failed); other exceptions propagate."""
        engines = list(self.engines if engines is None else engines)
        results = await asyncio.gather(*(fn(e) for e in engines), return_exceptions=True)
        for e, r in zip(engines, results):
            if isinstance(r, EngineError):
                self._retire(e, r)
            elif isinstance(r, BaseException):
                raise r

    async def on_each(self, fn, engines: Optional[list[Engine]] = None) -> None:
        """fn(engine) on `engines` (default: every live one) concurrently; an engine that
        fails is retired (raises once none is left or too many failed)."""
        await self._on_each(fn, [e for e in (engines or self.engines) if e in self.engines])

    @property
    def version(self) -> int:
        """The version every engine holds (they move together; the oldest if they differ)."""
        return min(e.version for e in self.engines)

    async def health(self) -> list[EngineHealth]:
        return list(await asyncio.gather(*(e.health() for e in self.engines)))


def _routed(engine: Engine, routes: bool) -> Engine:
    engine.routes = routes
    return engine


def _keep(done: GenResult, part: Optional[GenResult], prompt_len: int) -> None:
    """Append what an engine served before it failed (or was cut off) to `done` (routes: those
    of the tokens served before, then the new request's for positions past them)."""
    if part is not None:
        done.routes = routes.continued(done.routes, len(done.token_ids), prompt_len, part.routes)
        done.token_ids += part.token_ids
        done.logprobs += part.logprobs
        done.versions += part.versions


def _joined(done: GenResult, result: GenResult, engine: Engine, prompt_len: int) -> GenResult:
    """The final result: the tokens earlier engines served, then `engine`'s."""
    if done.token_ids:
        result.routes = routes.continued(done.routes, len(done.token_ids), prompt_len, result.routes)
        result.token_ids = done.token_ids + result.token_ids
        result.logprobs = done.logprobs + result.logprobs
        result.versions = done.versions + result.versions
    result.engine = engine.name
    return result


async def _gather_or_raise(coros, keep: type | tuple = ()) -> list:
    """The coroutines' results in order; the first exception raises, except those of `keep`,
    returned in their place."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, keep):
            raise r
    return results


class SyncPool:
    """The pool as the synchronous driver sees it: each call runs on the loop thread with a
    deadline of rollout.engines.timeout_s (longer for whole batches, see `generate_many`)."""

    def __init__(self, pool: EnginePool, loop: LoopThread, start_timeout_s: float):
        self.pool, self.loop = pool, loop
        try:
            self.loop.run(pool.start(), start_timeout_s, "starting the rollout engines",
                          "rollout.engines.start_timeout_s")
        except BaseException:
            # cut short (its deadline, a SIGTERM: distributed/stop.py): the start's own cleanup
            # was cancelled with it, so the engines it began (servers launched) are closed here
            try:
                self.loop.run(pool.close(), 120, "stopping the rollout engines")
            except Exception:   # noqa: BLE001 - the first error is the one to report
                pass
            raise

    @property
    def version(self) -> int:
        return self.pool.version

    @property
    def engines(self) -> list[Engine]:
        return self.pool.engines

    def call(self, coro: Awaitable, what: str, timeout: Optional[float] = None):
        return self.loop.run(coro, timeout or self.pool.timeout_s, what)

    def generate_many(self, requests: list[GenRequest]) -> list[GenResult]:
        """All requests concurrently; results in request order. The deadline scales with the
        number of requests per engine (each must make progress within rollout.engines.timeout_s)."""
        return self.call(self.pool.generate_all(requests), f"generating {len(requests)} samples",
                         self.pool.deadline_for(len(requests)))

    def reload_weights(self, path: str, version: int) -> None:
        self.call(self.pool.reload_weights(path, version), f"loading weight version {version}")

    @property
    def timeout_s(self) -> float:
        return self.pool.timeout_s

    def health(self) -> list[EngineHealth]:
        return self.call(self.pool.health(), "engine health check")

    def close(self) -> None:
        try:
            self.loop.run(self.pool.close(), 120, "stopping the rollout engines")
        finally:
            self.loop.stop()


def open_pool(cfg, model_path: str, seed: int, log_dir: str, weight_backend: str = "",
              routes: bool = False, lora_rank: int = 0) -> SyncPool:
    """Build and start the engines of `cfg` (a RolloutConfig), on a fresh loop thread, able to
    receive weights with `weight_backend` (build.weight_backend; "": files only); `routes`:
    they capture the experts each token was routed to (routing replay, routes.wanted);
    `lora_rank` > 0: they serve the trainer's LoRA adapters (build.lora_rank).
    On failure every engine started so far is stopped and the loop ends."""
    loop = LoopThread()
    try:
        def replace(slot):     # a fresh engine<slot>: same settings, seed and log file
            return _routed(build_engine(cfg, model_path, seed, log_dir, slot, weight_backend, lora_rank), routes)
        engines = [_routed(e, routes) for e in build_engines(cfg, model_path, seed, log_dir, weight_backend, lora_rank)]
        pool = EnginePool(engines, cfg.engines.timeout_s,
                          cfg.engines.failures_max, replace if cfg.engines.restart else None,
                          cfg.update_mode, cfg.keep_kv)
        return SyncPool(pool, loop, cfg.engines.start_timeout_s)
    except BaseException:
        loop.stop()
        raise
