"""Remote engine: a vLLM OpenAI-compatible server behind the engine protocol.

The server must run with `VLLM_SERVER_DEV_MODE=1` (that mounts /pause, /resume, /is_paused,
/abort_requests, /collective_rpc and /reset_prefix_cache) and `--logprobs-mode
processed_logprobs` (else the logprobs are those of the raw logits, not of the distribution
sampled from). `servers.LocalServer` starts such a server; a cluster script may start them by
hand (see docs/engines.md).

Its parts: `http_stream.py` (each sample one streamed `/v1/completions` request, its abort);
this module starts and checks the server, makes its control calls (pause, resume, health)
and loads weights (files, or vLLM's weight-transfer routes).

vLLM's --api-key guards only /v1, /v2, /inference and /cohere; servers megarl starts add
`megarl.rollout.engines.auth.RequireKey`, which refuses every other route but /health without the key
(control and weight-transfer endpoints included). The key is sent on every call.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import sys
import time
from typing import Optional

import aiohttp

from megarl.rollout import routes
from megarl.rollout.engines import held_tokens, lora_slots, route_capture, staged_swap
from megarl.rollout.engines.engine import (
    STALE_SESSION,
    Engine,
    EngineError,
    EngineHealth,
    settle_streams,
)
from megarl.rollout.engines.http_stream import ABORT_GRACE_S, StreamedRequests, _Flight
from megarl.rollout.engines.vllm_settings import ADAPTER_KEY

# vLLM's server closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s by default);
# aiohttp would reuse one idle for up to 15 s, and a request sent as the server closes it fails
# with ServerDisconnectedError on a healthy engine. Reusing only connections idle for less than
# this keeps every request clear of that close (megarl's own servers also get a longer one).
CLIENT_KEEPALIVE_S = 2.0
SERVER_KEEPALIVE_S = 60
_POLL_S = 0.25


class HTTPVLLMEngine(StreamedRequests, Engine):
    """One vLLM server reached over HTTP. The server process is not ours: close() only
    disconnects (see `servers.LocalServerEngine` for a server megarl starts and stops)."""

    def __init__(self, name: str, url: str, api_key: str, timeout_s: float, log_path: str = "",
                 start_timeout_s: Optional[float] = None, max_model_len: int = 0):
        self.name = name
        self.max_model_len = max_model_len      # rollout.engines.max_model_len: the server must hold it (0: unchecked)
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s if start_timeout_s is not None else timeout_s
        self.log_path = log_path
        self.version = 0
        self.model: Optional[str] = None        # served model name, from GET /v1/models
        self._session: Optional[aiohttp.ClientSession] = None
        self._paused = False
        self._inflight: dict[str, _Flight] = {}  # X-Request-Id -> flight
        self._ids = itertools.count()
        self._tag = secrets.token_hex(3)        # request ids stay unique across clients of one server
        self._capturing = False                 # the server's workers capture routes (routes set)
        self.lora_model: Optional[str] = None    # the adapter requests name once a push swapped it in
        self._adapter_pushed: Optional[dict] = None   # this update's adapter spec, until its finish

    # -- messages ------------------------------------------------------------------------------
    def _where(self) -> str:
        log = self.log_path or "the server's own log (megarl did not start it)"
        return f"engine {self.name} ({self.url}, log {log})"

    def _failure_detail(self) -> str:
        """Extra context for a failed call (a subclass that owns the process adds its state)."""
        return ""

    def _check_process(self) -> None:
        """Raise EngineError if the server process is known to be dead (only a subclass knows)."""

    async def _settle(self) -> None:
        """Before reporting a lost connection: let a dying server finish dying, so that
        `_failure_detail` can report it (its sockets close before its exit status exists)."""

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self._open_session()
        await self._wait_healthy(self.start_timeout_s)
        await self._discover()
        if self.routes:   # routing replay: megarl's capture in the server's workers (route_capture.py)
            got = await self._collective(route_capture.START)
            self._capturing = route_capture.started(got, self.name, self.model or self.url)

    async def _collective(self, method: str, args: tuple = ()) -> list:
        """The server's /collective_rpc (VLLM_SERVER_DEV_MODE): each worker's answer."""
        status, body = await self._call("POST", "/collective_rpc", {"method": method, "args": list(args)}, check=False)
        if status != 200 or not isinstance(body.get("results"), list):
            raise EngineError(f"{self._where()}: POST /collective_rpc {method} -> HTTP {status}: {str(body)[:300]}. "
                              f"Routing replay (algo.routing_replay=r3) needs megarl installed beside the server's "
                              f"vLLM (its plugin adds {method}); else set algo.routing_replay=off")
        return body["results"]

    async def _attach_routes(self, flights: list[_Flight], keep: bool) -> None:
        """Each flight's routes, trimmed to its tokens (`keep`: the requests are held and go on)."""
        rows = await route_capture.fetch(self._collective, [f.vllm_id for f in flights], keep) \
            if self._capturing else {}
        for f in flights:
            want = routes.expected_rows(f.prompt_len, len(f.result.token_ids))
            f.result.routes = routes.fit(rows.get(f.vllm_id), want)

    def _open_session(self) -> None:
        if self._session is None:
            # limit=0: one connection per streamed request; aiohttp's default caps at 100
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S),
                headers={"Authorization": f"Bearer {self.api_key}"} if self.api_key else None)

    async def _wait_healthy(self, timeout_s: float) -> None:
        """Poll GET /health until the server answers 200; for a remote server, say every few
        seconds on stderr what it waits for. Gives up a little before `timeout_s`, so that this error, which
        names the URL, comes before the pool's own deadline for the whole start (the same
        rollout.engines.start_timeout_s). A remote server (one megarl did not start) that never
        answered is the user's input: its error exits 2 like other bad inputs (megarl/cli.py)."""
        start = time.monotonic()
        deadline = start + max(timeout_s - 2.0, 0.9 * timeout_s)
        remote = type(self) is HTTPVLLMEngine
        what = "rollout.engines.urls" if remote else "the server megarl started"
        last, said = "no answer yet", start
        while True:
            self._check_process()
            left = deadline - time.monotonic()
            try:
                async with self._session.get(self.url + "/health",
                                             timeout=aiohttp.ClientTimeout(total=max(min(5.0, left), 0.1))) as r:
                    if r.status == 200:
                        return
                    last = f"HTTP {r.status}"
                    if remote and r.status == 404:   # vLLM always serves /health: waiting cannot help
                        err = EngineError(f"{self._where()}: {self.url}/health answers HTTP 404: that is not a "
                                          f"vLLM server. Fix: check the host and port in rollout.engines.urls")
                        err.exit_code = 2
                        raise err
            except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                last = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            now = time.monotonic()
            if now + _POLL_S > deadline:
                err = EngineError(
                    f"{self._where()}: no server answered GET {self.url}/health within {timeout_s:.0f} s "
                    f"({last}).{self._failure_detail()} Fix: check that a vLLM server runs at that URL "
                    f"({what}) and is reachable from this node, or raise rollout.engines.start_timeout_s")
                err.exit_code = 2 if remote else 1
                raise err
            if remote and now - said >= 5.0:   # a server we started reports through its log
                said = now
                print(f"megarl: waiting for engine {self.name} at {self.url} ({what}): {last}; "
                      f"{now - start:.0f} s of rollout.engines.start_timeout_s={timeout_s:g}",
                      file=sys.stderr, flush=True)
            await asyncio.sleep(_POLL_S)

    async def _discover(self) -> None:
        """Served model name, and a fail-fast check of the key and of the dev-mode endpoints."""
        status, body = await self._call("GET", "/v1/models", check=False)
        if status == 401:
            raise EngineError(f"{self._where()}: the server rejected the API key (HTTP 401 on /v1/models). "
                              f"Fix: set rollout.engines.api_key (or $MEGARL_ENGINE_API_KEY) to the server's --api-key")
        if status != 200 or not body.get("data"):
            raise EngineError(f"{self._where()}: GET /v1/models -> HTTP {status} {str(body)[:300]}")
        self.model = body["data"][0]["id"]
        self._check_context(body["data"][0].get("max_model_len"))
        status, body = await self._call("GET", "/is_paused", check=False)
        if status == 404:
            raise EngineError(f"{self._where()}: the server has no /is_paused endpoint. Fix: start it with "
                              f"VLLM_SERVER_DEV_MODE=1 (megarl needs /pause, /abort_requests, /collective_rpc)")
        if status != 200:
            raise EngineError(f"{self._where()}: GET /is_paused -> HTTP {status} {str(body)[:300]}")
        self._paused = bool(body.get("is_paused"))

    def _check_context(self, served) -> None:
        """A server whose context is shorter than rollout.engines.max_model_len would refuse the
        run's longer requests one by one: refused here, at start, as the bad input it is."""
        if not self.max_model_len or not isinstance(served, int) or served >= self.max_model_len:
            return
        err = EngineError(f"{self._where()}: the server's max_model_len={served} (GET /v1/models) is smaller "
                          f"than rollout.engines.max_model_len={self.max_model_len}. Fix: start the server with "
                          f"--max-model-len {self.max_model_len} or more, or set "
                          f"rollout.engines.max_model_len={served}")
        err.exit_code = 2
        raise err

    async def close(self) -> None:
        if self._session is None:
            return
        for f in list(self._inflight.values()):   # resolve what is running with its partial result
            f.aborted = True
            f.stop()
        if self._inflight:
            await asyncio.wait([f.resolved for f in self._inflight.values()], timeout=ABORT_GRACE_S)
        session, self._session = self._session, None
        await session.close()

    # -- control calls -------------------------------------------------------------------------
    async def _call(self, method: str, path: str, json_body=None, check: bool = True,
                    timeout_s: Optional[float] = None, own_connection: bool = False):
        """One non-streamed call; returns (status, parsed body). Transport errors -> EngineError.
        `own_connection`: for a call that may fail inside the server (HTTP 500): uvicorn closes
        the connection after an unhandled error, and the next call must not reuse it."""
        if self._session is None:
            raise EngineError(f"{self._where()}: not started (or already closed)")
        try:
            async with self._session.request(
                    method, self.url + path, json=json_body,
                    headers={"Connection": "close"} if own_connection else None,
                    timeout=aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)) as r:
                text = await r.text()
                status = r.status
        except asyncio.TimeoutError:
            raise EngineError(f"{self._where()}: {method} {path} got no answer within "
                              f"{timeout_s or self.timeout_s:.0f} s (rollout.engines.timeout_s)."
                              f"{self._failure_detail()}") from None
        except aiohttp.ClientError as err:
            raise EngineError(f"{self._where()}: {method} {path} failed: {type(err).__name__}: {err}. "
                              f"The server may have died; see its log.{self._failure_detail()}") from err
        try:
            body = json.loads(text) if text else {}
        except ValueError:
            body = {"text": text}
        if check and status != 200:
            raise EngineError(f"{self._where()}: {method} {path} -> HTTP {status}: {text[:500]}")
        return status, body

    async def pause(self) -> None:
        # keep: running requests are frozen in the scheduler and continue after /resume.
        # clear_cache=false: the server's default (true) also drops their KV (a recompute of
        # every held request on resume); rollout.keep_kv decides that, through clear_kv()
        await self._call("POST", "/pause?mode=keep&clear_cache=false")
        self._paused = True
        if self._inflight:   # what the server streamed before it stopped may still be on its way to us
            await self._hold_every_token()
            if self.routes:  # partial() of a held request carries its routes
                await self._attach_routes(list(self._inflight.values()), keep=True)

    async def held_counts(self) -> Optional[dict[str, int]]:
        """{request key: tokens the paused server generated for it} of this client's requests
        in flight, from the server's own count (held_tokens.py; servers megarl starts serve
        /megarl/held_tokens); None for a server without the route (started by hand)."""
        status, body = await self._call("GET", held_tokens.ROUTE, check=False)
        if status == 404:
            return None
        if status != 200 or not isinstance(body.get("tokens"), dict):
            raise EngineError(f"{self._where()}: GET {held_tokens.ROUTE} -> HTTP {status}: {str(body)[:300]}")
        tokens = body["tokens"]
        return {f.key: tokens[f.vllm_id] for f in self._inflight.values() if f.vllm_id in tokens}

    async def _hold_every_token(self) -> None:
        """Until every held request has streamed to us each token the engine generated before
        the pause. A server without the count gets the older rule: wait until the streams are
        quiet for a moment."""
        counts = await self.held_counts()
        if counts is None:
            await settle_streams(lambda: sum(len(f.result.token_ids) for f in self._inflight.values()))
            return
        flights = {f.key: f for f in self._inflight.values()}

        def received(key: str):
            f = flights.get(key)
            return None if f is None or f.resolved.done() else len(f.result.token_ids)

        await held_tokens.wait_for_held(counts, received, self.timeout_s, self._where())

    async def clear_kv(self) -> None:
        """Preempt the held requests (their KV recomputed on resume) and reset the prefix cache."""
        _, body = await self._call("POST", "/reset_prefix_cache?reset_running_requests=true")
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineError(f"{self._where()}: the KV cache could not be reset with requests held "
                              f"(rollout.keep_kv=false); set rollout.keep_kv=true")

    async def resume(self) -> None:
        await self._call("POST", "/resume")
        self._paused = False

    def _check_quiet(self, what: str) -> None:
        # held requests may stay (rollout.update_mode=keep): they resume under the new version
        if not self._paused:
            raise EngineError(f"{self._where()}: {what} needs the engine paused (call pause() first)")

    async def reload_weights(self, path: str, version: int) -> None:
        self._check_quiet("reload_weights")
        try:
            await self._call("POST", "/collective_rpc",
                             {"method": "reload_weights", "kwargs": {"weights_path": path}})
        except EngineError as err:
            raise EngineError(f"{err} (loading weights from {path}: the directory must hold HF-named "
                              f"safetensors readable by the server's host)") from None
        await self._loaded(version)

    async def _loaded(self, version: int) -> None:
        # the prefix cache holds KV computed with the old weights: a hit would mix versions
        await self._call("POST", "/reset_prefix_cache")
        # informational: the server then reports the version in GET /weight_info
        await self._call("POST", "/update_weight_version", {"new_version": str(version)}, check=False)
        self.version = version

    # -- collective transport: vLLM's weight-transfer routes (VLLM_SERVER_DEV_MODE=1) ----------
    async def transfer_world_size(self) -> int:
        _, body = await self._call("GET", "/get_world_size")
        return int(body["world_size"])

    async def init_weight_transfer(self, init_info: dict) -> None:
        timeout = float(init_info.get("timeout_s", self.timeout_s)) + 60
        status, body = await self._call("POST", "/init_weight_transfer_engine", {"init_info": init_info},
                                        check=False, timeout_s=timeout, own_connection=True)
        if status != 200:
            text = str(body)[:400]
            hint = (" Fix: start the server with --weight-transfer-config '{\"backend\": \"gloo\"}' "
                    "(\"nccl\" on GPUs; megarl's servers get it), or set weight_sync.transport=files"
                    if "weight_transfer_config" in text or status == 404 else "")
            raise EngineError(f"{self._where()}: joining the weight group -> HTTP {status}: {text}.{hint}")

    async def start_weight_update(self, staged: bool = False) -> None:
        if not staged:                   # staged: the engine generates while the version arrives
            self._check_quiet("a weight update")
        status, body = await self._call("POST", "/start_weight_update", check=False, own_connection=True)
        if status != 200 and STALE_SESSION in str(body):
            # a trainer died mid-session (this server outlives trainers): close it, open ours
            await self._call("POST", "/finish_weight_update", {"weight_version": None}, own_connection=True)
            status, body = await self._call("POST", "/start_weight_update", check=False, own_connection=True)
        if status != 200:
            raise EngineError(f"{self._where()}: POST /start_weight_update -> HTTP {status}: {str(body)[:500]}")

    async def update_weights(self, update_info: dict) -> None:
        self._adapter_pushed = update_info.get(ADAPTER_KEY) or self._adapter_pushed
        await self._call("POST", "/update_weights", {"update_info": update_info}, own_connection=True)

    async def finish_weight_update(self, version: int) -> None:
        await self._call("POST", "/finish_weight_update", {"weight_version": str(version)})
        spec, self._adapter_pushed = self._adapter_pushed, None
        if spec is not None:     # swapped in while paused, then served under its name
            lora_slots.check_swapped(await self._collective(lora_slots.SWAP), self.name)
            status, body = await self._call("POST", lora_slots.ROUTE, {"name": spec["name"], "id": spec["id"]},
                                            check=False)
            if status != 200:
                raise EngineError(f"{self._where()}: POST {lora_slots.ROUTE} -> HTTP {status}: {str(body)[:300]}. "
                                  f"weight_sync.lora=adapters needs a server started as megarl starts them "
                                  f"(python -m megarl.rollout.engines.serve: --enable-lora and megarl's "
                                  f"middleware {lora_slots.__name__}.AdapterRoute); else set weight_sync.lora=merged")
            self.lora_model = spec["name"]
        await self._loaded(version)

    async def staged_ready(self) -> bool:
        return staged_swap.all_ready(await self._collective(staged_swap.READY))

    async def health(self) -> EngineHealth:
        alive, paused = False, self._paused
        try:
            status, _ = await self._call("GET", "/health", check=False, timeout_s=min(self.timeout_s, 10))
            alive = status == 200
            if alive:
                status, body = await self._call("GET", "/is_paused", check=False, timeout_s=min(self.timeout_s, 10))
                paused = bool(body.get("is_paused", paused)) if status == 200 else paused
        except EngineError:
            alive = False
        return EngineHealth(self.name, alive, paused, self.running, self.version, self.url, self.log_path)
