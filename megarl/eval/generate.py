"""The evaluation's requests, sent to the engine pool beside whatever else runs there.

Requests go through `EnginePool.generate` under keys of their own (`eval<version>-d<dataset>-g<i>s<j>`),
so the partial-rollout controller's book (its concurrency, carry and staleness, all counted
over its own keys) never sees them, and an engine that fails mid-evaluation is retired and the
request continued elsewhere, as for any request. At most eval.concurrency are in flight; the
driver thread waits for them with a progress bar (tqdm) and the pool's deadline.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from concurrent.futures import wait
from typing import Callable, ContextManager

from megarl.data.seeds import eval_prompt_seed
from megarl.metrics.progress import progress_bar as tqdm  # plain lines in a log file
from megarl.rollout.controller.sync_rollout import group_requests
from megarl.rollout.engines.engine import GenRequest, RequestError


def eval_requests(version: int, dataset: int, prompts: list[list[int]], n: int, max_tokens: int,
                  temperature: float, run_seed: int, top_p: float = 1.0) -> list[GenRequest]:
    """n requests per prompt, in prompt order (the sync round's `group_requests`). Greedy
    (temperature 0) requests carry no seed; sampled ones a seed of the evaluation's own stream
    (seeds.eval_prompt_seed), the same at every version, so two evaluations differ by the
    weights, not by the draws. `top_p` (eval.top_p): nucleus sampling, which evaluation may use
    (no trainer logprobs are computed for its samples)."""
    seeds = [eval_prompt_seed(run_seed, dataset, i) for i in range(len(prompts))] if temperature > 0 else None
    requests = group_requests(prompts, n, max_tokens, temperature, seeds, tag=f"eval{version}-d{dataset}-")
    return requests if top_p == 1.0 else [dataclasses.replace(r, top_p=top_p) for r in requests]


async def generate_limited(pool, requests: list[GenRequest], limit: int, done: list[int]) -> list:
    """Each request's result or the RequestError it was refused with, in request order, at most
    `limit` in flight; `done[0]` counts the finished ones (read by the driver's progress bar).
    Any other failure raises once every request has resolved (none is left running)."""
    gate = asyncio.Semaphore(limit)

    async def one(req: GenRequest):
        async with gate:
            try:
                return await pool.generate(req)
            finally:
                done[0] += 1
    results = await asyncio.gather(*(one(r) for r in requests), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, RequestError):
            raise r
    return results


def run_requests(sync_pool, requests: list[GenRequest], limit: int, label: str, progress: bool,
                 cut: Callable[[], ContextManager] = contextlib.nullcontext) -> list:
    """Driver thread: `generate_limited` on the pool's loop, a tqdm bar moving as requests end,
    within the pool's deadline for that many requests. `cut` (StopSignal.interruptible) wraps
    the wait alone, inside the block that cancels the requests: a SIGTERM that lands while they
    are being handed to the loop is held until the wait begins, then raises there, so no
    request is left running (raised during the hand-over, the future would be lost)."""
    done = [0]
    future = sync_pool.loop.submit(generate_limited(sync_pool.pool, requests, limit, done))
    end = time.monotonic() + sync_pool.pool.deadline_for(len(requests))
    try:
        with cut(), tqdm(total=len(requests), desc=label, unit="sample", leave=False, disable=not progress,
                         dynamic_ncols=True) as bar:
            while not future.done() and time.monotonic() < end:
                wait([future], 1.0)
                bar.update(done[0] - bar.n)
    except BaseException:   # this thread was interrupted (a SIGTERM's Stopped): the requests end too
        future.cancel()
        raise
    return sync_pool.loop.wait(future, 0 if not future.done() else None, f"evaluating {label}")
