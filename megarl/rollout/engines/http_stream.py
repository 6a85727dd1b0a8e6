"""The requests of an HTTP engine: each sample one streamed `/v1/completions` request, its
abort, and the views of what is in flight.

Every sample is one streamed `/v1/completions` request with a token-id prompt and n=1, so the
tokens and logprobs received so far are the partial result when it is aborted: the stream is
the only source of truth, never a separate call. Each request carries our own X-Request-Id;
vLLM names the request `cmpl-<X-Request-Id>-0`, which is what `/abort_requests` takes.

`StreamedRequests` is a part of `vllm_http.HTTPVLLMEngine`, split out by concept: it works on
the engine's session, its book of requests in flight (`_inflight`) and its control calls
(`_call`), on the pool's event loop.
"""
from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from typing import Optional

import aiohttp

from megarl.rollout import routes
from megarl.rollout.engines.engine import (
    EngineError,
    GenRequest,
    GenResult,
    RequestError,
    ServerError,
    copy_result,
)

# an aborted stream ends within milliseconds on a healthy server; past this grace we close
# the connection ourselves (vLLM aborts a request whose client disconnected), so abort never hangs
ABORT_GRACE_S = 5.0
# /v1/completions answers that refuse the request itself (vLLM's validation: prompt longer than
# max_model_len, token ids outside the vocabulary, sampling options out of range; a body too
# large): the request's error (RequestError), never a reason to retire the server
REFUSED_STATUS = (400, 413, 422)


def _error_message(text: str) -> str:
    """The message of vLLM's error body {"error": {"message": ...}} (else the text, cut)."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:500]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])[:1000]
    return text[:500]


@dataclass
class _Flight:
    """One request in flight: what abort() needs to end it and to know when it has resolved."""
    key: str
    rid: str                                    # our X-Request-Id
    result: GenResult
    resolved: asyncio.Future
    aborted: bool = False
    response: Optional[aiohttp.ClientResponse] = None
    reader: Optional[asyncio.Task] = None       # the pending POST or read of the stream
    prompt_len: int = 0
    _stopped: bool = field(default=False, repr=False)

    @property
    def vllm_id(self) -> str:
        return f"cmpl-{self.rid}-0"             # completions: cmpl-<X-Request-Id>-<prompt index>

    def stop(self) -> None:
        """Force the stream to end now (abort fallback, close): cancel the read, drop the socket."""
        self._stopped = True
        if self.reader is not None and not self.reader.done():
            self.reader.cancel()
        if self.response is not None:
            self.response.close()

class StreamedRequests:
    """Requests over the server's streamed completions (a base of `HTTPVLLMEngine`)."""

    @property
    def running(self) -> int:
        return len(self._inflight)

    def progress(self, key: str) -> int:
        """Tokens received so far by the in-flight request `key` (0 if none): for monitoring."""
        return sum(len(f.result.token_ids) for f in self._inflight.values() if f.key == key)

    def partial(self, key: str) -> Optional[GenResult]:
        for f in self._inflight.values():
            if f.key == key:
                out = copy_result(f.result)   # routes read at the last pause: none for tokens since
                out.routes = routes.fit(out.routes, routes.expected_rows(f.prompt_len, len(out.token_ids)))
                return out
        return None

    def _payload(self, req: GenRequest) -> dict:
        # the trainer's adapter once a push swapped it in (weight_sync.lora=adapters), else the base
        model = getattr(self, "lora_model", None) or self.model
        return {"model": model, "prompt": list(req.prompt_ids), "max_tokens": req.max_tokens,
                "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed,
                "ignore_eos": req.ignore_eos, "logprobs": 0, "return_token_ids": True,
                "return_tokens_as_token_ids": True, "stream": True, "n": 1}

    async def generate(self, req: GenRequest) -> GenResult:
        if self._session is None:
            raise EngineError(f"{self._where()}: not started (or already closed)")
        # header-safe, unique, and readable in the server log
        rid = f"{re.sub(r'[^A-Za-z0-9_.:-]', '_', req.key)[:64]}-{self._tag}{next(self._ids)}"
        f = _Flight(req.key, rid, GenResult(req.key, engine=self.name),
                    asyncio.get_running_loop().create_future(), prompt_len=len(req.prompt_ids))
        self._inflight[rid] = f
        try:
            await self._stream(req, f)
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as err:
            if not (f.aborted or f._stopped):
                await self._settle()
                raise EngineError(f"{self._where()}: connection lost during request {req.key} "
                                  f"({type(err).__name__}: {err}); the server may have died, see its log."
                                  f"{self._failure_detail()}", partial=f.result) from err
            # we aborted it: the tokens streamed so far are the result
        except EngineError as err:   # HTTP error, garbage, a silent stream: keep what arrived too
            if err.partial is None:
                err.partial = f.result
            raise
        finally:
            self._inflight.pop(rid, None)
            if not f.resolved.done():
                f.resolved.set_result(None)
        # a request that completed just before our abort keeps its true reason; anything else
        # (vLLM's "abort", a stream we closed, one that ended before its first token) is an abort
        if f.result.finish_reason not in ("stop", "length"):
            f.result.finish_reason = "abort"
        if self.routes:
            await self._attach_routes([f], keep=False)
        return f.result

    async def _stream(self, req: GenRequest, f: _Flight) -> None:
        """POST the request and fold its SSE chunks into f.result; returns when the stream ends."""
        if f.aborted:
            return

        async def post():
            return await self._session.post(self.url + "/v1/completions", json=self._payload(req),
                                            headers={"X-Request-Id": f.rid},
                                            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s))

        resp = await self._wait_alive(req, f, post(), "sent no response headers")
        if resp is None:                                # stop() while connecting
            return
        f.response = resp
        clean = False
        try:
            if resp.status != 200:
                text = await resp.text()
                hint = (" Fix: rollout.engines.api_key must equal the server's --api-key" if resp.status == 401 else "")
                raise self._answered(req, resp.status, f"HTTP {resp.status}: {_error_message(text)}",
                                     f"-> HTTP {resp.status}: {text[:500]}.{hint}")
            buf = b""
            while not f._stopped:
                # whatever has arrived (often many SSE lines at once): one wait per network read
                data = await self._wait_alive(req, f, resp.content.readany(), "streamed nothing")
                if not data:                            # EOF, or stop()
                    if not (f.aborted or f._stopped):
                        raise EngineError(f"{self._where()}: the stream of request {req.key} ended without "
                                          f"[DONE]; the server may have died, see its log.{self._failure_detail()}")
                    return
                *lines, buf = (buf + data).split(b"\n")
                for line in lines:
                    if self._fold(req, f, line.strip()):
                        clean = True
                        return
        finally:
            if clean:
                resp.release()                          # fully read: the connection is reused
            else:
                resp.close()                            # vLLM aborts a request whose client went away

    async def _wait_alive(self, req: GenRequest, f: _Flight, coro, what: str):
        """Await `coro` (a read of the stream) as a task that stop() can cancel. Silence for
        timeout_s is an error, except while we hold the engine paused (vLLM then freezes running
        and new requests on purpose) or abort() owns the request. The timeout never cancels the
        read itself, so no byte is lost. Returns None if stop() cancelled it."""
        f.reader = asyncio.ensure_future(coro)
        try:
            while True:
                done, _ = await asyncio.wait({f.reader}, timeout=self.timeout_s)
                if done:
                    break
                if not (self._paused or f.aborted):
                    raise EngineError(f"{self._where()}: request {req.key} {what} for {self.timeout_s:.0f} s "
                                      f"(rollout.engines.timeout_s); the server is hung or overloaded, see its log."
                                      f"{self._failure_detail()}")
            return None if f.reader.cancelled() else f.reader.result()
        finally:
            if not f.reader.done():
                f.reader.cancel()
            f.reader = None

    def _answered(self, req: GenRequest, code, message: str, detail: str) -> Exception:
        """The error for the server's answer `code` (an HTTP status, or an error chunk's code)
        to `req`: the request's own for REFUSED_STATUS (RequestError; `message`, the engine named
        by name only), the server's failure of this request for 5xx (ServerError: it is up and
        said so, the pool may retry it there), else the engine's (EngineError, with `detail`)."""
        if code in REFUSED_STATUS:
            return RequestError(f"engine {self.name} refused request {req.key}: {message}", req.key)
        kind = ServerError if isinstance(code, int) and code >= 500 else EngineError
        return kind(f"{self._where()}: request {req.key} {detail}")

    def _fold(self, req: GenRequest, f: _Flight, line: bytes) -> bool:
        """Apply one SSE line to the result; True at the end of the stream."""
        if not line.startswith(b"data:"):
            return False                                # SSE comments / other fields
        data = line[5:].strip()
        if data == b"[DONE]":
            return True
        try:
            chunk = json.loads(data)
        except ValueError:
            raise EngineError(f"{self._where()}: request {req.key}: unreadable stream chunk {data[:200]!r}") from None
        if "error" in chunk:
            error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk["error"]}
            raise self._answered(req, error.get("code"), str(error.get("message")),
                                 f"failed on the server: {json.dumps(chunk['error'])[:500]}")
        for choice in chunk.get("choices", ()):
            ids = choice.get("token_ids") or []
            lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
            if ids or lps:
                f.result.extend(list(ids), [float(x) for x in lps], self.version)
            if choice.get("finish_reason") is not None:
                f.result.finish_reason = choice["finish_reason"]
        return False

    async def abort(self, keys: Optional[list[str]] = None) -> None:
        wanted = set(keys) if keys is not None else None
        flights = [f for f in self._inflight.values() if wanted is None or f.key in wanted]
        if not flights:
            return
        for f in flights:
            f.aborted = True
        try:
            await self._call("POST", "/abort_requests", {"request_ids": [f.vllm_id for f in flights]},
                             timeout_s=min(self.timeout_s, ABORT_GRACE_S))
        except EngineError:
            pass    # server unreachable: closing the streams below resolves the requests anyway
        pending = [f for f in flights if not f.resolved.done()]
        if pending:
            _, late = await asyncio.wait([f.resolved for f in pending], timeout=ABORT_GRACE_S)
            for f in pending:
                if not f.resolved.done():
                    f.stop()    # the server did not end it (e.g. the abort raced the request's arrival)
            if late:
                await asyncio.wait(late, timeout=ABORT_GRACE_S)
