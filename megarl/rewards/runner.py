"""The run's reward: every kind of verifier (plain, batched, async; megarl.rewards.entry)
scored off the caller's thread, with bounded concurrency, a timeout per call, and failures
counted instead of raised.

The runner owns an event loop on a thread of its own ("megarl-reward"): an `async def` verifier
is awaited there, a plain one runs in a pool of `reward.concurrency` threads, an isolated one in
as many worker processes (megarl.rewards.verify.Worker, started on first use). So a slow reward
never blocks the engines' event loop: the partial rollout awaits `submit`'s future and goes on
serving requests meanwhile (megarl.rollout.controller.scoring).

- Concurrency: at most `reward.concurrency` calls in flight (one call = one sample, or one batch
  of a batched verifier).
- Batching: a batched verifier is called with whole groups (group-relative advantages need a
  group's rewards together), as many as fit in `reward.batch_size` samples (0: one group per
  call). A group is taken as soon as a call is free: a group never waits for others to fill a
  batch, only for a free call, while the groups that finished meanwhile join it.
- Timeout: a call past `reward.timeout_s` scores its samples 0 and is counted (reward_timeouts);
  an isolated verifier's worker is killed, a plain function's thread cannot be (it runs on,
  holding one of the threads: a verifier that can hang should be isolated); a call that raises,
  or a score that is not a finite number, scores 0 and is counted (reward_errors). A batched
  verifier returning a number of scores other than its batch's stops the run (RewardOutputError:
  no score can be matched to its sample), as does a worker that cannot start.
"""
from __future__ import annotations

import asyncio
import functools
import math
import queue
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

from megarl.config.extension import module_source
from megarl.rewards.entry import VerifierEntry
from megarl.rewards.verify import Failures, Worker, WorkerStartError, WorkerTimeout


class RewardOutputError(ValueError):
    """A batched verifier's result cannot be matched to its samples: the run stops with it."""


def _score(value) -> float:
    """One sample's score as a finite float (raises TypeError / ValueError otherwise)."""
    out = float(value)
    if not math.isfinite(out):   # a NaN reward would stop the run (train.on_nonfinite)
        raise ValueError(f"returned {value}")
    return out


class RewardRunner:
    """Scores groups of samples with verifier `entry` on its own loop thread. Thread-safe:
    `submit` from any thread (the engines' loop, the driver), `score_groups` / a call blocks.
    A group is (response_texts, records, finished): lists, one element per sample."""

    def __init__(self, entry: VerifierEntry, *, timeout_s: float, concurrency: int = 1, batch_size: int = 0,
                 name: str = "", kwargs: dict | None = None):
        if concurrency < 1:
            raise ValueError(f"reward.concurrency={concurrency}: must be >= 1 (calls of the verifier at once)")
        self.entry, self.timeout_s = entry, timeout_s
        self.concurrency, self.batch_size = concurrency, batch_size
        self.name = name or getattr(entry.fn, "__name__", "verifier")
        self.kwargs = dict(kwargs or {})
        self.counts = Failures(self.name)
        self.calls = 0                        # verifier calls made (a batch is one)
        self._threads = ThreadPoolExecutor(concurrency, thread_name_prefix="megarl-reward-call")
        # isolated: one worker process per call slot, each started on its first call (no more
        # start than are used at once); `_idle` holds those no call holds
        warm = (module_source(entry.fn.__module__),)
        self.workers = [Worker(warm) for _ in range(concurrency if entry.isolated else 0)]
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        for w in self.workers:
            self._idle.put(w)
        self._start_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # on the runner's loop: plain verifiers' call slots, batched ones' waiting groups
        self._slots: asyncio.Semaphore | None = None
        self._waiting: deque = deque()
        self._active = 0
        self._tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ any thread
    def submit(self, texts: Sequence[str], records: Sequence[dict], finished: Sequence[bool]) -> Future:
        """A concurrent Future of the group's scores (list[float], in order)."""
        loop = self._ensure_loop()
        return asyncio.run_coroutine_threadsafe(self._group(list(texts), list(records), list(finished)), loop)

    def score_groups(self, groups: Sequence[tuple]) -> list[list[float]]:
        """Each group's scores, the groups submitted together (batched and scored concurrently)."""
        futures = [self.submit(*g) for g in groups]
        return [f.result() for f in futures]

    def __call__(self, response_text: str, record: dict, *, finished: bool) -> float:
        """One sample's score (blocks): the per-sample signature, for callers of one sample."""
        return self.submit([response_text], [record], [finished]).result()[0]

    def take_counts(self) -> dict:
        """Errors and timeouts since the previous call (the step's metrics)."""
        return self.counts.take()

    def close(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._threads.shutdown(wait=False, cancel_futures=True)
        for w in self.workers:
            w.close()

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._start_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def serve():
                    asyncio.set_event_loop(loop)
                    self._slots = asyncio.Semaphore(self.concurrency)
                    loop.call_soon(ready.set)
                    loop.run_forever()
                self._thread = threading.Thread(target=serve, name="megarl-reward", daemon=True)
                self._thread.start()
                ready.wait()
                self._loop = loop
            return self._loop

    # ------------------------------------------------------------------ the runner's loop
    async def _group(self, texts: list, records: list, finished: list) -> list[float]:
        if not texts:
            return []
        if not self.entry.batched:
            return list(await asyncio.gather(*(self._one(t, r, f) for t, r, f in zip(texts, records, finished))))
        done = asyncio.get_running_loop().create_future()
        self._waiting.append(((texts, records, finished), done))
        self._dispatch()
        return await done

    async def _one(self, text: str, record: dict, finished: bool) -> float:
        async with self._slots:
            return (await self._call((text, record), finished, 1))[0]

    def _dispatch(self) -> None:
        """Batched verifiers: while a call is free, one with the waiting groups, oldest first, as
        many as fit in batch_size samples (at least one group)."""
        while self._waiting and self._active < self.concurrency:
            jobs = [self._waiting.popleft()]
            size = len(jobs[0][0][0])
            while self._waiting and size + len(self._waiting[0][0][0]) <= self.batch_size:
                jobs.append(self._waiting.popleft())
                size += len(jobs[-1][0][0])
            self._active += 1
            task = asyncio.ensure_future(self._batch(jobs))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _batch(self, jobs: list) -> None:
        try:
            texts = [t for (g, _) in jobs for t in g[0]]
            records = [r for (g, _) in jobs for r in g[1]]
            finished = [f for (g, _) in jobs for f in g[2]]
            scores = await self._call((texts, records), finished, len(texts))
            at = 0
            for (g, done) in jobs:
                if not done.done():
                    done.set_result(scores[at:at + len(g[0])])
                at += len(g[0])
        except BaseException as err:   # noqa: BLE001 - the groups' callers get the error (it stops the run)
            for _, done in jobs:
                if not done.done():
                    done.set_exception(err)
        finally:
            self._active -= 1
            self._dispatch()

    async def _call(self, args: tuple, finished, samples: int) -> list[float]:
        """One call of the verifier for `samples` samples: their scores, 0 for each on a
        timeout or an error (counted)."""
        fn, loop = self.entry.fn, asyncio.get_running_loop()
        kwargs = {**self.kwargs, "finished": finished}
        self.calls += 1
        try:
            if self.entry.isolated:   # the worker times the call (its start-up is not counted)
                value = await loop.run_in_executor(self._threads, self._in_worker, args, kwargs)
            elif self.entry.is_async:
                value = await asyncio.wait_for(fn(*args, **kwargs), self.timeout_s)
            else:
                value = await asyncio.wait_for(
                    loop.run_in_executor(self._threads, functools.partial(fn, *args, **kwargs)), self.timeout_s)
        except (TimeoutError, WorkerTimeout) as err:
            self.counts.note("timed out", err if str(err) else TimeoutError(f"no result within {self.timeout_s} s"),
                             timeout=True, samples=samples)
            return [0.0] * samples
        except (WorkerStartError, asyncio.CancelledError):
            raise
        except Exception as err:   # noqa: BLE001 - a verifier's failure is its samples' 0, never the run's end
            self.counts.note("failed", err, timeout=False, samples=samples)
            return [0.0] * samples
        return self._batch_scores(value, samples) if self.entry.batched else [self._checked(value)]

    def _in_worker(self, args: tuple, kwargs: dict):
        worker = self._idle.get()
        try:
            return worker.call(self.entry.fn, args, kwargs, self.timeout_s)
        finally:
            self._idle.put(worker)

    def _checked(self, value) -> float:
        """A score, or 0 counted as an error (not a finite number)."""
        try:
            return _score(value)
        except (TypeError, ValueError) as err:
            self.counts.note("returned no score", ValueError(f"{value!r} is not a finite number ({err})"),
                             timeout=False)
            return 0.0

    def _batch_scores(self, value, samples: int) -> list[float]:
        try:
            values = list(value)
        except TypeError:
            values = None
        if values is None or isinstance(value, (str, bytes, dict)) or len(values) != samples:
            what = f"{len(values)} scores" if values is not None else f"{type(value).__name__} {value!r:.60}"
            raise RewardOutputError(
                f"reward.fn={self.name}: a batched verifier returned {what} for a batch of {samples} "
                f"samples: return a list of one float per sample, in the order of response_texts")
        return [self._checked(v) for v in values]
