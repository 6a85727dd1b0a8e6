"""In-process engine: vLLM's `AsyncLLM` behind the engine protocol.

`AsyncLLM` always runs its engine core in a child process, so vLLM's side effects (thread
settings, NUMA binding, its own torch.distributed world) stay out of the trainer. Outputs are
streamed as deltas, so an aborted request keeps every token delivered before the abort.
Weights arrive through vLLM's weight-transfer session (weight_sync.transport=collective: the
engine core's workers receive the trainer's broadcast themselves), or with
`reload_weights(weights_path=...)` from staged safetensors files (files; tensors passed in
kwargs would be pickled as lists across the process boundary).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Optional

import torch

from megarl.rollout import routes
from megarl.rollout.engines import held_tokens, lora_slots, plugin, reaper, route_capture, staged_swap
from megarl.rollout.engines.engine import (
    STALE_SESSION,
    Engine,
    EngineError,
    EngineHealth,
    GenRequest,
    GenResult,
    RequestError,
    copy_result,
)
from megarl.rollout.engines.vllm_settings import ADAPTER_KEY, engine_settings

# vLLM itself is imported inside the methods that use it: building engines (build.py), the pool
# and the trainer's imports stay free of it; only a started in-process engine needs it.


def sampling_params(req: GenRequest):
    """vLLM SamplingParams for one sample: deltas, the sampled token's logprob (logprobs=0)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    return SamplingParams(n=1, max_tokens=req.max_tokens, temperature=req.temperature,
                          top_p=req.top_p, top_k=req.top_k, seed=req.seed, logprobs=0, ignore_eos=req.ignore_eos,
                          output_kind=RequestOutputKind.DELTA)


def sampled_logprobs(token_ids, logprobs) -> list[float]:
    """Logprob of each sampled token from vLLM's per-position {token: Logprob} dicts."""
    if logprobs is None:
        raise EngineError("vLLM returned no logprobs: the request must ask for logprobs=0")
    return [float(d[t].logprob) for t, d in zip(token_ids, logprobs)]


def span_versions(spans, stamped: list[int]) -> list[int]:
    """Each token's version from vLLM's weight-version spans (labels are the versions megarl
    set: finish_weight_update, or update_weight_version after a files push); tokens under a
    label that is not a number (vLLM's "default" before the first push) keep the version the
    client stamped when it received them."""
    out = list(stamped)
    for span in spans or []:
        label = str(span.version)
        if label.lstrip("-").isdigit():
            out[span.start:span.end] = [int(label)] * (min(span.end, len(out)) - span.start)
    return out


def refused_by_vllm(err: BaseException) -> bool:
    """vLLM refused the request itself (its input or sampling validation: a prompt longer than
    max_model_len, token ids outside the vocabulary, sampling options out of range): vLLM
    raises these as `VLLMClientError`s, the errors it answers with HTTP 4xx. Anything else (a
    dead engine core, a failed step, an overloaded queue) is the engine's."""
    from vllm.exceptions import VLLMClientError  # vLLM is loaded: the error came from it
    return isinstance(err, VLLMClientError)


ABORT_POLL_S = 0.05


class AsyncVLLMEngine(Engine):
    """One vLLM AsyncLLM engine. `engine_args` are vLLM AsyncEngineArgs keyword arguments."""

    def __init__(self, name: str, model_path: str, engine_args: dict, timeout_s: float,
                 env: Optional[dict] = None):
        self.name = name
        self.env = dict(env or {})      # set while vLLM spawns the engine core (its workers inherit it)
        self.model_path = model_path
        self.engine_args = engine_args
        self.timeout_s = timeout_s
        self.version = 0
        self.llm = None
        self._paused = False
        self._inflight: dict[str, asyncio.Task] = {}     # request id -> task draining its stream
        self._results: dict[str, GenResult] = {}         # request id -> what it streamed so far
        self._ids = 0
        self._capturing = False     # megarl's route capture runs in the workers (routes on CPU)
        self._prompt_len: dict[str, int] = {}            # request id -> its prompt's tokens
        # the trainer's adapter (weight_sync.lora=adapters): every request names it once a push
        # has swapped it into the workers (before that the engine's base is the adapted model:
        # the adapters start with B = 0)
        self._lora = None
        self._adapter_pushed: dict | None = None         # this update's adapter spec, until its finish

    async def start(self) -> None:
        reaper.private_rpc_dir()      # before vLLM reads VLLM_RPC_BASE_PATH
        if self.engine_args.get("weight_transfer_config"):
            plugin.register()         # this process too (the engine core registers it itself)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        args = {**self.engine_args, **route_capture.engine_args(self.routes, torch.cuda.is_available())}
        try:
            # from_engine_args spawns the engine core and waits for it, without yielding to the
            # loop: no other engine's start can see this environment
            with _environ(self.env):
                self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=self.model_path, **args))
        except Exception as err:  # vLLM raises many kinds; the user needs to know which engine
            raise EngineError(f"engine {self.name} (in-process vLLM, model {self.model_path}) failed "
                              f"to start: {type(err).__name__}: {err}") from err
        if self.routes and not args.get("enable_return_routed_experts"):
            # CPU: megarl's capture in the workers (route_capture.py); a dense model has none
            self._capturing = route_capture.started(await self._collective(route_capture.START), self.name,
                                                    self.model_path)

    @property
    def running(self) -> int:
        return len(self._inflight)

    async def generate(self, req: GenRequest) -> GenResult:
        if self.llm is None:
            raise EngineError(f"engine {self.name} is closed")
        result = GenResult(req.key, engine=self.name)
        self._ids += 1
        rid = f"{req.key}#{self._ids}"   # vLLM ids must be unique even when a key is resubmitted

        async def drain():
            stream = self.llm.generate({"prompt_token_ids": list(req.prompt_ids)},
                                       sampling_params(req), request_id=rid, lora_request=self._lora)
            async for out in stream:
                c = out.outputs[0]
                ids = list(c.token_ids)
                result.extend(ids, sampled_logprobs(ids, c.logprobs), self.version)
                if out.finished:
                    result.finish_reason = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"
                    result.routes = getattr(c, "routed_experts", None)   # vLLM's own capture (GPU)
                    # a request held over a weight update spans versions: vLLM knows which token
                    # came from which (its spans cover this request's tokens from 0)
                    result.versions = span_versions(getattr(c, "weight_versions", None), result.versions)

        task = asyncio.ensure_future(drain())
        self._inflight[rid] = task
        self._results[rid] = result
        self._prompt_len[rid] = len(req.prompt_ids)
        try:
            await self._watch(task, result)
        except asyncio.TimeoutError:
            await self.llm.abort(rid)
            task.cancel()
            raise EngineError(f"engine {self.name} (in-process vLLM): request {req.key} produced no token "
                              f"for {self.timeout_s:.0f} s while the engine ran (rollout.engines.timeout_s)") from None
        except asyncio.CancelledError:
            # the request was aborted (or the caller gave up): resolve with what was streamed
            if not task.done():
                task.cancel()
        except EngineError:
            raise
        except Exception as err:
            if refused_by_vllm(err):
                raise RequestError(f"engine {self.name} refused request {req.key}: {err}", req.key) from err
            raise EngineError(f"engine {self.name} (in-process vLLM) failed on request {req.key}: "
                              f"{type(err).__name__}: {err}") from err
        finally:
            self._inflight.pop(rid, None)
            self._results.pop(rid, None)
            self._prompt_len.pop(rid, None)
        if self.routes:
            await self._attach_routes({rid: result}, req.prompt_ids, keep=False)
        return result

    async def _attach_routes(self, results: dict[str, GenResult], prompt_ids=None, keep: bool = True) -> None:
        """Each result's routes, trimmed to its tokens: from megarl's capture in the workers
        (`keep`: the requests are held and go on), else what vLLM returned at the end."""
        if self._capturing and self.llm is not None:
            rows = await route_capture.fetch(self._collective, list(results), keep)
            for rid, r in results.items():
                r.routes = rows.get(rid)
        for rid, r in results.items():
            n = len(prompt_ids) if prompt_ids is not None else self._prompt_len.get(rid, 0)
            r.routes = routes.fit(r.routes, routes.expected_rows(n, len(r.token_ids)))

    def progress(self, key: str) -> int:
        """Tokens streamed so far by the in-flight request `key` (0 if none): for monitoring."""
        return sum(len(r.token_ids) for r in self._results.values() if r.key == key)

    def partial(self, key: str) -> Optional[GenResult]:
        for rid, r in self._results.items():
            if r.key == key:
                out = copy_result(r)
                # routes read at the last pause; tokens streamed since have none yet
                rows = routes.expected_rows(self._prompt_len.get(rid, 0), len(out.token_ids))
                out.routes = routes.fit(out.routes, rows)
                return out
        return None

    async def _watch(self, task: asyncio.Task, result: GenResult) -> None:
        """Until the stream task ends; asyncio.TimeoutError when a whole rollout.engines.timeout_s
        passed without a new token while the engine was not paused. Silence, not the request's
        age: a request held paused over a trainer step (rollout.update_mode=keep) lives long."""
        seen = -1
        while True:
            done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
            if done:
                return task.result()
            if not self._paused and len(result.token_ids) == seen:
                raise asyncio.TimeoutError
            seen = -1 if self._paused else len(result.token_ids)

    async def abort(self, keys: Optional[list[str]] = None) -> None:
        """Abort, and return once every aborted request has resolved with its partials.

        vLLM ignores an abort for a request id it has not registered yet (its stream task has
        not reached AsyncLLM.add_request), and that request would then run to its full budget
        while we wait: a round's tail with few requests in flight. So the abort is re-issued
        every ABORT_POLL_S for whatever still runs; after rollout.engines.timeout_s our reader
        is cancelled (which closes the stream and aborts it in vLLM), so an abort never hangs."""
        if self.llm is None:
            return
        wanted = set(keys) if keys is not None else None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while True:
            rids = [rid for rid in self._inflight if wanted is None or rid.rsplit("#", 1)[0] in wanted]
            if not rids:
                return
            tasks = [self._inflight[r] for r in rids]
            await self.llm.abort(rids)
            _, pending = await asyncio.wait(tasks, timeout=ABORT_POLL_S)
            if not pending:
                return await self._resolved(rids)
            if loop.time() > deadline:
                for t in pending:
                    t.cancel()
                await asyncio.wait(pending, timeout=5)
                return await self._resolved(rids)

    async def _resolved(self, rids: list[str]) -> None:
        """Until the generate() calls of `rids` have returned (the protocol: abort returns after
        them). Each leaves _inflight in its finally, a loop iteration or two after its stream
        task ended; bounded, so a call that never returns cannot hold the abort."""
        for _ in range(1000):
            if not any(r in self._inflight for r in rids):
                return
            await asyncio.sleep(0)

    async def pause(self) -> None:
        if self._paused:   # a weight update right after a keep-mode round end: paused already
            return
        await self.llm.pause_generation(mode="keep", clear_cache=False)
        self._paused = True
        if self._results:  # the last outputs the core sent before it stopped may still be in the client's queues
            await self._hold_every_token()
            if self.routes:    # partial() of a held request carries its routes
                await self._attach_routes(dict(self._results))

    async def _hold_every_token(self) -> None:
        """Until every held request's stream has given us each token the engine core generated
        before the pause (held_tokens.py: the core counts them)."""
        counts = await self._rpc("counting the held requests' tokens", held_tokens.held_by_external_id(self.llm))

        def received(rid: str):
            r = self._results.get(rid)
            return None if r is None or rid not in self._inflight else len(r.token_ids)

        await held_tokens.wait_for_held(counts, received, self.timeout_s, f"engine {self.name} (in-process vLLM)")

    async def clear_kv(self) -> None:
        """Preempt the held requests (their KV freed, recomputed on resume) and reset the prefix cache."""
        if not await self._rpc("dropping the held requests' KV",
                               self.llm.reset_prefix_cache(reset_running_requests=True)):
            raise EngineError(f"engine {self.name} (in-process vLLM): the KV cache could not be reset "
                              f"with requests held (rollout.keep_kv=false); set rollout.keep_kv=true")

    async def resume(self) -> None:
        await self.llm.resume_generation()
        self._paused = False

    def _check_quiet(self, what: str) -> None:
        # held requests may stay (rollout.update_mode=keep): they resume under the new version
        if not self._paused:
            raise EngineError(f"engine {self.name}: {what} needs the engine paused")

    async def _collective(self, method: str, args: tuple = ()):
        """vLLM's collective_rpc on every worker (megarl's route capture), bounded."""
        return await self._rpc(f"calling {method} on the workers", self.llm.collective_rpc(method, args=args))

    async def _rpc(self, what: str, coro, timeout_s: Optional[float] = None):
        """One control call on the engine core, bounded, with errors that name the engine."""
        timeout_s = timeout_s or self.timeout_s
        try:
            return await asyncio.wait_for(coro, timeout_s)
        except asyncio.TimeoutError:
            raise EngineError(f"engine {self.name} (in-process vLLM): {what} took longer than "
                              f"{timeout_s:.0f} s (rollout.engines.timeout_s)") from None
        except EngineError:
            raise
        except Exception as err:
            raise EngineError(f"engine {self.name} (in-process vLLM): {what} failed: "
                              f"{type(err).__name__}: {err}") from err

    async def reload_weights(self, path: str, version: int) -> None:
        self._check_quiet("reload_weights")
        await self._rpc(f"loading weights from {path}",
                        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path}))
        await self._rpc("resetting the prefix cache", self.llm.reset_prefix_cache())
        # vLLM labels each output token's weights (the spans `span_versions` reads): a files
        # push must move the label too, or a held request's later tokens would keep the last
        # collective push's label
        await self._rpc("labelling the weight version", self.llm.update_weight_version(str(version)))
        self.version = version

    # -- collective transport: vLLM's weight-transfer session on the AsyncLLM -----------------
    async def transfer_world_size(self) -> int:
        return int(self.engine_args.get("tensor_parallel_size", 1)) * \
            int(self.engine_args.get("pipeline_parallel_size", 1))

    async def init_weight_transfer(self, init_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest
        if not self.engine_args.get("weight_transfer_config"):
            raise EngineError(f"engine {self.name}: started without a weight-transfer config "
                              f"(weight_sync.transport=files)")
        # joining waits for every member: allow the group's own timeout, then some
        await self._rpc("joining the weight group",
                        self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info)),
                        float(init_info.get("timeout_s", self.timeout_s)) + 60)

    async def start_weight_update(self, staged: bool = False) -> None:
        if not staged:                   # staged: the engine generates while the version arrives
            self._check_quiet("a weight update")
        try:
            await self._rpc("starting a weight update", self.llm.start_weight_update())
        except EngineError as err:
            if STALE_SESSION not in str(err):
                raise
            # a trainer died mid-session: close its session, then open ours
            await self._rpc("closing a dead trainer's weight update", self.llm.finish_weight_update())
            await self._rpc("starting a weight update", self.llm.start_weight_update())

    async def update_weights(self, update_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest
        self._adapter_pushed = update_info.get(ADAPTER_KEY) or self._adapter_pushed
        await self._rpc("receiving weights", self.llm.update_weights(WeightTransferUpdateRequest(update_info)))

    async def finish_weight_update(self, version: int) -> None:
        await self._rpc("finishing a weight update", self.llm.finish_weight_update(str(version)))
        await self._rpc("resetting the prefix cache", self.llm.reset_prefix_cache())
        self.version = version
        spec, self._adapter_pushed = self._adapter_pushed, None
        if spec is not None:     # swapped in while paused: requests name it from here on
            lora_slots.check_swapped(await self._collective(lora_slots.SWAP), self.name)
            self._lora = lora_slots.lora_request(spec["name"], spec["id"])

    async def staged_ready(self) -> bool:
        return staged_swap.all_ready(await self._collective(staged_swap.READY))

    async def health(self) -> EngineHealth:
        alive = self.llm is not None and not getattr(self.llm, "errored", False)
        return EngineHealth(self.name, alive, self._paused, self.running, self.version, "in-process")

    async def close(self) -> None:
        if self.llm is None:
            return
        llm, self.llm = self.llm, None
        for t in list(self._inflight.values()):
            t.cancel()
        llm.shutdown()


@contextlib.contextmanager
def _environ(extra: dict):
    """os.environ with `extra` set, restored afterwards."""
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def engine_args(cfg, seed: int, index: int, weight_backend: str = "", lora_rank: int = 0) -> dict:
    """AsyncEngineArgs keywords from the rollout config: the settings servers megarl starts get
    too (vllm_settings.engine_settings), plus this process's quiet logging.
    `weight_backend`: the weight-transfer backend the engine receives with ("": files only);
    `lora_rank`: > 0 to serve the trainer's LoRA adapters (vllm_settings.lora_settings)."""
    args = engine_settings(seed=seed + index, max_model_len=cfg.engines.max_model_len, tp=cfg.engines.tp,
                           enforce_eager=cfg.engines.enforce_eager, kv_cache_mb=cfg.engines.kv_cache_mb,
                           gpu_memory_utilization=cfg.engines.gpu_memory_utilization,
                           cuda=torch.cuda.is_available(), weight_backend=weight_backend,
                           expert_parallel=cfg.engines.expert_parallel, lora_rank=lora_rank)
    args.update(disable_log_stats=True, use_tqdm_on_load=False)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    return args
