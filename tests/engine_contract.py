"""The engine contract (megarl/rollout/engines/engine.py, module docstring) as checks every engine kind
passes: in-process vLLM (tests/e2e/pool_sync_probe.py), HTTP against a megarl-started server
(tests/e2e/test_http_engine.py), the scripted engine and the simulated engine
(tests/unit/test_engine_pool.py). Each check is a coroutine taking a `Subject`, run by the
test file that already owns a running engine of that kind (no engine is started here).
A check leaves the engine as it found it: running, not paused, at its weight version.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch

from megarl.rollout.engines.engine import FINISH_REASONS, Engine, EngineError, GenRequest, GenResult


@dataclass
class Subject:
    """An engine under the contract and what the checks need to know about its model."""
    engine: Engine
    prompt: Callable[[int], list[int]]      # prompt i; its response never stops before the budget
    # log softmax(logits / T) of each generated token after the prompt: the engine's model
    # (transformers for vLLM, the scripted model for fakes)
    reference: Callable[[list[int], list[int], float], list[float]]
    weights: str                            # a reload_weights path holding the engine's current weights
    long: int                               # a budget no request reaches while a check waits to abort it
    span: int = 200                         # a budget a request is paused in the middle of, and then finishes
    # |engine - reference| logprobs allowed: kernels sum in other orders (vLLM vs the trainer:
    # 1.5e-6 measured, test_pool_sync), a wrong or missing weight moves them by 1e-2 or more
    tol: float = 1e-4
    tempered: bool = True                   # its distribution depends on the temperature (fakes: not)
    progress: Optional[Callable[[str], int]] = None   # tokens streamed so far by key (None: wait settle_s)
    settle_s: float = 0.05
    timeout_s: float = 120.0
    # other weights and their reference: (a reload_weights path, reference under them); None:
    # the engine's model has no weights (fakes)
    changed: Optional[tuple[str, Callable[[list[int], list[int], float], list[float]]]] = None


# figures a check measured, by engine and name (a probe may write them out; nothing asserts on them here)
MEASURED: dict = {}


async def _until(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


async def _streaming(s: Subject, keys: list[str], tasks: list) -> None:
    """Until every request in `keys` has tokens (or, without `progress`, runs for settle_s)."""
    e = s.engine
    if s.progress is not None:
        await _until(lambda: all(s.progress(k) > 0 for k in keys) or any(t.done() for t in tasks),
                     s.timeout_s, f"{e.name}: {keys} streaming")
    else:
        await _until(lambda: e.running >= len(keys) or any(t.done() for t in tasks), s.timeout_s,
                     f"{e.name}: {keys} running")
        await asyncio.sleep(s.settle_s)
    assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]


def hf_model(path):
    """The transformers model of a model folder, fp32: the reference for real engines."""
    from transformers import AutoModelForCausalLM  # heavy: only where a real engine is checked
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def changed_weights(src, dst) -> str:
    """A copy of the model folder `src` in `dst` whose every tensor moved by 5% of its spread
    (seeded): other weights for `Subject.changed`, the same architecture and files."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file
    os.makedirs(dst, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if name.endswith(".safetensors"):
            tensors = load_file(path)
            save_file({k: v + 0.05 * v.float().std() * torch.randn(v.shape, generator=g).to(v.dtype)
                       for k, v in tensors.items()}, os.path.join(dst, name), metadata={"format": "pt"})
        elif os.path.isfile(path):
            shutil.copy(path, dst)
    return str(dst)


@torch.no_grad()
def hf_logprobs(model, prompt_ids, gen_ids, temperature):
    """log softmax(logits / T) of each generated token, from one forward over prompt + tokens."""
    logits = model(torch.tensor([prompt_ids + gen_ids])).logits[0].float() / temperature
    lp = torch.log_softmax(logits, -1)
    return [lp[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(gen_ids)]


def _aligned(res: GenResult, budget: int) -> None:
    assert len(res.token_ids) == len(res.logprobs) == len(res.versions) <= budget, res
    assert res.finish_reason in FINISH_REASONS, res.finish_reason
    assert res.stopped == (res.finish_reason == "stop")


def _gen(s: Subject, key: str, i: int, budget: int, temperature: float = 1.0, seed: int = 0) -> GenRequest:
    return GenRequest(key, s.prompt(i), budget, temperature=temperature, seed=seed, ignore_eos=True)


async def budget_ends_with_length(s: Subject) -> None:
    """A request runs to its budget: finish_reason "length", not `stopped`, one token, logprob
    and version each, every version the engine's, the engine's name on it; nothing left running."""
    e, n = s.engine, 8
    res = await e.generate(_gen(s, "c-budget", 0, n))
    _aligned(res, n)
    assert res.finish_reason == "length" and len(res.token_ids) == n and not res.stopped
    assert res.versions == [e.version] * n and res.engine == e.name and res.key == "c-budget"
    assert e.running == 0


async def logprobs_are_of_the_sampled_distribution(s: Subject) -> None:
    """The logprob of each sampled token is log_softmax(logits / T) of the engine's model, at T
    below and at 1; for a model whose distribution depends on T, the raw (T=1) logprobs of
    tokens sampled at T=0.7 differ from what is reported (the temperature reached them)."""
    e = s.engine
    for t, temperature in enumerate((0.7, 1.0)):
        reqs = [_gen(s, f"c-lp{t}-{i}", 10 + i, 12, temperature, seed=i) for i in range(3)]
        results = await asyncio.gather(*(e.generate(r) for r in reqs))
        for req, res in zip(reqs, results):
            _aligned(res, 12)
            assert len(res.token_ids) == 12, res
            ref = s.reference(req.prompt_ids, res.token_ids, temperature)
            gap = max(abs(a - b) for a, b in zip(ref, res.logprobs))
            assert gap < s.tol, (e.name, temperature, gap)
            if s.tempered and temperature != 1.0:
                raw = s.reference(req.prompt_ids, res.token_ids, 1.0)
                assert max(abs(a - b) for a, b in zip(raw, res.logprobs)) > 10 * s.tol, (e.name, "untempered")


async def abort_resolves_with_the_partial(s: Subject) -> None:
    """abort(keys) returns once those requests resolved with finish_reason "abort" and the
    tokens streamed so far (aligned, not stopped); the others stay until abort() ends them
    all; an abort of keys not running returns at once; nothing is left running. The requests
    are held by a pause when they are aborted (an abort of held requests is what a keep-mode
    round end and a weight update do; the HTTP tests abort running ones too)."""
    e = s.engine
    keys = [f"c-abort{i}" for i in range(3)]
    tasks = [asyncio.ensure_future(e.generate(_gen(s, k, 20 + i, s.long, seed=i))) for i, k in enumerate(keys)]
    try:
        await _streaming(s, keys, tasks)
        # held by a pause, no request can reach its budget before the aborts below, however
        # fast the engine or slow the client: the check cannot be outrun
        await e.pause()
        assert all(e.partial(k) is not None for k in keys), "a request ended before the pause held it"
        await e.abort([keys[0]])
        assert tasks[0].done(), f"abort() returned before the aborted generate() resolved ({e.running} running)"
        assert not any(t.done() for t in tasks[1:]), "abort([key]) ended other requests"
        await e.abort()
        assert all(t.done() for t in tasks), "abort() returned before every generate() resolved"
    finally:
        await e.abort()
        await e.resume()
    for t in tasks:
        res = t.result()
        _aligned(res, s.long)
        assert res.finish_reason == "abort" and 0 < len(res.token_ids) < s.long and not res.stopped, res
        assert set(res.versions) == {e.version}
    # a key nobody runs: abort returns (the deadline only turns a hang into a failure)
    await asyncio.wait_for(e.abort(["c-nobody"]), 120)
    assert e.running == 0


async def pause_holds_requests_without_aborting_them(s: Subject) -> None:
    """A request running when the engine pauses is held, not aborted: it makes no progress
    while paused and goes on after resume() (where the engine reports progress), still
    running; an abort then ends it with its tokens, all of one weight version."""
    e = s.engine
    for attempt in range(3):
        key = f"c-held{attempt}"
        task, held = await _paused_while_running(s, key)
        if task is not None:
            break
    else:
        raise AssertionError(f"every request reached its budget ({s.long}) before pause() did: raise Subject.long")
    assert not (await e.health()).paused
    if s.progress is not None:      # it goes on
        await _until(lambda: s.progress(key) > held or task.done(), s.timeout_s, f"{key} resuming")
    assert not task.done(), task.result()
    await e.abort([key])
    res = task.result()
    _aligned(res, s.long)
    assert res.finish_reason == "abort" and res.token_ids and set(res.versions) == {e.version}


async def _paused_while_running(s: Subject, key: str):
    """Start `key`, pause while it streams, check it is held, resume: (task, tokens at the
    pause), or (None, 0) when it had already generated its whole budget before the pause took
    hold (a fast engine whose stream the client reads behind): the check's precondition, not
    its outcome, so the caller tries again."""
    e, held = s.engine, 0
    task = asyncio.ensure_future(e.generate(_gen(s, key, 30, s.long, seed=3)))
    try:
        await _streaming(s, [key], [task])
        await e.pause()
        assert (await e.health()).paused
        await asyncio.sleep(s.settle_s)
        if s.progress is not None:
            held = s.progress(key)
            await asyncio.sleep(s.settle_s)
            assert s.progress(key) == held, "tokens arrived while paused"
        if task.done() and task.result().finish_reason == "length" and len(task.result().token_ids) == s.long:
            return None, 0
        assert not task.done(), task.result()
    finally:
        await e.resume()
    return task, held


async def weights_arrive_while_paused_and_held_requests_go_on(s: Subject) -> None:
    """reload_weights refuses (EngineError) on a running engine; paused with a request held
    (rollout.update_mode=keep) it loads, the engine reports the version, and the held request
    goes on after resume(): `partial()` at the pause is a prefix of its result, its tokens
    from there on carry the new version, those before the old one. Over an update to the same
    weights a greedy request continues with exactly the tokens of an uninterrupted one, with
    its KV kept and dropped (`clear_kv`) alike. Later requests carry the new version. The
    check ends back at the engine's own version."""
    e = s.engine
    before = e.version
    with pytest.raises(EngineError, match="paused"):
        await e.reload_weights(s.weights, before + 7)
    plain = await e.generate(_gen(s, "c-greedy", 50, s.span, temperature=0.0, seed=5))
    new = before
    try:
        for clear in (False, True):
            new += 7
            res, k = await _held_over_update(s, f"c-span{int(clear)}", s.weights, new, clear)
            assert res.token_ids == plain.token_ids, (clear, k, "held greedy request diverged")
            assert res.versions == [new - 7] * k + [new] * (len(res.token_ids) - k), (k, res.versions)
        res = await e.generate(_gen(s, "c-after", 41, 6))
        assert res.versions == [new] * 6, res.versions
    finally:
        await e.pause()
        await e.reload_weights(s.weights, before)
        await e.resume()
    assert e.version == before and (await e.health()).version == before


async def held_tokens_after_an_update_come_from_the_new_weights(s: Subject) -> None:
    """Held over an update to other weights (`Subject.changed`): with the KV dropped, the
    tokens after the update carry the new version and their logprobs are those of the new
    weights given the whole context (within tol); the tokens before, the old weights'. With
    the KV kept they are not (the next tokens attend to KV of the old weights). Skipped for
    engines whose model has no weights."""
    if s.changed is None:
        pytest.skip("the engine's model has no weights to change")
    e, (path, reference) = s.engine, s.changed
    before, prompt = e.version, s.prompt(50)
    gaps = {}
    try:
        for clear in (True, False):
            res, k = await _held_over_update(s, f"c-new{int(clear)}", path, before + 1, clear, temperature=1.0)
            assert res.versions == [before] * k + [before + 1] * (len(res.token_ids) - k)
            old = s.reference(prompt, res.token_ids[:k], 1.0)
            assert max(abs(a - b) for a, b in zip(old, res.logprobs[:k])) < s.tol
            ref = reference(prompt, res.token_ids, 1.0)[k:]
            gaps[clear] = max(abs(a - b) for a, b in zip(ref, res.logprobs[k:]))
            await e.pause()
            await e.reload_weights(s.weights, before)
            await e.resume()
    finally:
        if e.version != before:
            await e.pause()
            await e.reload_weights(s.weights, before)
            await e.resume()
    MEASURED[f"{e.name}/held_gap"] = {"kv_dropped": gaps[True], "kv_kept": gaps[False]}
    assert gaps[True] < s.tol, gaps
    assert gaps[False] > s.tol, gaps


async def _held_over_update(s: Subject, key: str, weights: str, version: int, clear: bool,
                            temperature: float = 0.0) -> tuple[GenResult, int]:
    """Start `key` (prompt 50, seeded), pause while it streams, load `weights` as `version`
    (then clear_kv() when `clear`), resume, and return its result and the tokens it had at
    the pause. Tried again (new key) when a request ran to its budget before the pause held."""
    e = s.engine
    for attempt in range(3):
        task = asyncio.ensure_future(e.generate(_gen(s, f"{key}.{attempt}", 50, s.span, temperature, seed=5)))
        try:
            try:
                await _streaming(s, [f"{key}.{attempt}"], [task])
            except AssertionError:
                if task.done():    # it finished before the client saw it stream: the precondition
                    continue
                raise
            await e.pause()
            part = e.partial(f"{key}.{attempt}")
            if part is None:               # it ended before the pause took hold
                assert task.done()
                continue
            await e.reload_weights(weights, version)
            assert e.version == version and (await e.health()).version == version
            if clear:
                await e.clear_kv()
        finally:
            await e.resume()
        res = await task
        _aligned(res, s.span)
        k = len(part.token_ids)
        assert res.token_ids[:k] == part.token_ids and res.versions[:k] == part.versions
        assert 0 < k < len(res.token_ids), (k, len(res.token_ids))
        return res, k
    raise AssertionError(f"every request reached its budget ({s.span}) before pause() did: raise Subject.span")


CHECKS = [budget_ends_with_length, logprobs_are_of_the_sampled_distribution, abort_resolves_with_the_partial,
          pause_holds_requests_without_aborting_them, weights_arrive_while_paused_and_held_requests_go_on,
          held_tokens_after_an_update_come_from_the_new_weights]


async def run_all(s: Subject) -> list[str]:
    """Every check in order; returns the names of those that passed (raises on the first failure)."""
    done = []
    for check in CHECKS:
        await check(s)
        done.append(check.__name__)
    return done
