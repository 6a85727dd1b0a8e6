"""The agent service's HTTP face: an OpenAI-compatible chat endpoint plus episode routes.

Routes (all but `GET /health` need `Authorization: Bearer <service.api_key>`):
- `GET /v1/models`: the one model, `service.model_name`.
- `POST /v1/episodes` -> {"episode_id", "group", "index", "task"}: a new episode and its task.
- `POST /v1/chat/completions`: OpenAI's chat completion, non-streaming; the episode is named by
  the `X-Episode-Id` header or the body's `episode_id` (the openai client's `extra_body`).
- `POST /v1/episodes/{id}/reward` {"reward": x}: ends the episode with its reward.
- `POST /v1/episodes/{id}/cancel`: ends it untrained (its place is handed out again).
- `GET /v1/episodes/{id}`: its recorded tokens (prompt_ids, response_ids, mask, logprobs, versions).

Sampling is the run's, not the agent's: the trainer's importance ratios assume each token was
drawn at the run's temperature, top_p and top_k and no penalties, so a request asking otherwise is
refused (400) instead of quietly served differently. Errors use OpenAI's shape
{"error": {"message", "type", "code", "param"}}, so agents' clients raise their usual errors;
an engine failure (503) or an internal error (500) says what happened without the engines'
addresses or log paths, which go to the trainer's log.

The service runs on the rollout's event loop, so what a client can make it do before it knows
the client is bounded (`Guard`, in front of the app): the key is checked on a request's headers,
and a request without it is answered 401 and its connection closed, none of its body read; at
most service.max_requests keyed requests are served at once (more: 503, sent again by OpenAI's
clients); a body larger than service.max_request_mb is refused (413) as it arrives, whether its
Content-Length says so or not.
Imported only when the service starts (fastapi comes with vLLM).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import math
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from megarl.rollout.engines.engine import EngineError
from megarl.service.recorder import ENGINE_FAILED, ServiceError

OPEN = {("GET", "/health")}
log = logging.getLogger("megarl.service")


def authorized(authorization: str, digest: bytes) -> bool:
    """`Authorization: Bearer <key>` against the key's sha256 digest, in constant time."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(hashlib.sha256(token.strip().encode()).digest(), digest)


def _number(body: dict, name: str):
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ServiceError(400, f"{name}={value!r} must be a number")
    return value


def _refuse_set(body: dict, name: str, why: str) -> None:
    if body.get(name):
        raise ServiceError(400, f"{name}={body[name]!r} is not supported: {why}")


def chat_options(body: dict, temperature: float, top_p: float = 1.0, top_k: int = -1) -> tuple[int | None, bool]:
    """Check a chat request's sampling options against the run's (rollout.sampling); (max_tokens,
    logprobs)."""
    if body.get("stream"):
        raise ServiceError(400, "stream=true is not supported: the service answers whole completions "
                                "(send stream=false or leave it out)")
    n = _number(body, "n")
    if n is not None and n != 1:
        raise ServiceError(400, f"n={n}: the service generates one completion per call (an episode is one "
                                f"sample; the group's other samples are other episodes)")
    asked_p = _number(body, "top_p")
    if asked_p is not None and not math.isclose(asked_p, top_p, rel_tol=0, abs_tol=1e-9):
        raise ServiceError(400, f"top_p={asked_p}: the service samples at the run's top_p={top_p:g} "
                                f"(rollout.sampling.top_p; the trainer's importance ratios assume it); "
                                f"leave top_p out")
    asked_k = _number(body, "top_k")
    if asked_k is not None and asked_k != top_k and not (asked_k in (0, -1) and top_k == -1):
        raise ServiceError(400, f"top_k={asked_k}: the service samples at the run's top_k={top_k} "
                                f"(rollout.sampling.top_k; the trainer's importance ratios assume it); "
                                f"leave top_k out")
    t = _number(body, "temperature")
    if t is not None and not math.isclose(t, temperature, rel_tol=0, abs_tol=1e-9):
        raise ServiceError(400, f"temperature={t} differs from the run's temperature {temperature:g} "
                                f"(rollout.sampling.temperature): the trainer's importance ratios assume every "
                                f"token was sampled at it; send {temperature:g} or leave temperature out")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name):
            raise ServiceError(400, f"{name}={body[name]}: penalties change the sampling distribution the "
                                    f"trainer assumes; leave {name} out")
    _refuse_set(body, "logit_bias", "it changes the sampling distribution the trainer assumes")
    _refuse_set(body, "stop", "episodes end turns on the model's end-of-turn token only")
    _refuse_set(body, "tools", "tool schemas would change the rendered prompt; describe tools in the messages")
    _refuse_set(body, "top_logprobs", "only the sampled tokens' logprobs are returned")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ServiceError(400, f"max_tokens={max_tokens!r} must be an integer >= 1")
    return max_tokens, bool(body.get("logprobs"))


def episode_of(headers, body: dict) -> str:
    eid = headers.get("x-episode-id") or body.get("episode_id")
    if not eid or not isinstance(eid, str):
        raise ServiceError(400, "no episode: send the id POST /v1/episodes returned as the X-Episode-Id header "
                                "or the body field episode_id (openai client: extra_body={'episode_id': id})")
    return eid


def completion_body(reply, model: str, logprobs: bool, created: int) -> dict:
    """A ChatCompletion as OpenAI's API answers it."""
    choice = {"index": 0, "message": {"role": "assistant", "content": reply.content},
              "finish_reason": reply.finish_reason, "logprobs": None}
    if logprobs:
        choice["logprobs"] = {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                                           "top_logprobs": []} for tok, lp in zip(reply.tokens, reply.logprobs)],
                              "refusal": None}
    completion = len(reply.token_ids)
    return {"id": f"chatcmpl-{reply.episode_id}-{reply.call}", "object": "chat.completion", "created": created,
            "model": model, "choices": [choice],
            "usage": {"prompt_tokens": reply.prompt_tokens, "completion_tokens": completion,
                      "total_tokens": reply.prompt_tokens + completion}}


async def _json(request) -> dict:
    try:
        body = await request.json()
    except ValueError as err:
        raise ServiceError(400, f"the request body is not JSON: {err}") from err
    if not isinstance(body, dict):
        raise ServiceError(400, "the request body must be a JSON object")
    return body


def create_app(service):
    """The ASGI app serving `service` (an AgentService): its routes behind `Guard` (its key
    checked on every route but /health, its requests in flight and their bodies bounded)."""
    app = FastAPI(title="megarl agent service", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, err: ServiceError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(EngineError)
    async def engine_error(request: Request, err: EngineError):
        # an engine failure met outside a chat call (an abort of a cancelled episode's request)
        log.warning("megarl: %s %s failed on the engines: %s", request.method, request.url.path, err)
        return JSONResponse(ServiceError(503, ENGINE_FAILED).body(), status_code=503)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        # an agent's client expects OpenAI's error shape on a 500 too; what went wrong (which may
        # name engines, paths) goes to the trainer's log
        log.error("megarl: agent service error on %s %s", request.method, request.url.path, exc_info=err)
        body = {"error": {"message": "internal error of the megarl agent service (reported in the trainer's log)",
                          "type": "server_error", "code": None, "param": None}}
        return JSONResponse(body, status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": 0,
                                            "owned_by": "megarl"}]}

    @app.post("/v1/episodes")
    async def open_episode():
        return service.open_episode()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _json(request)
        max_tokens, logprobs = chat_options(body, service.temperature, service.top_p, service.top_k)
        reply = await service.chat(episode_of(request.headers, body), body.get("messages"), max_tokens)
        return completion_body(reply, service.model_name, logprobs, int(time.time()))

    @app.post("/v1/episodes/{episode_id}/reward")
    async def reward(episode_id: str, request: Request):
        body = await _json(request)
        if "reward" not in body:
            raise ServiceError(400, "the body must hold the reward, as {\"reward\": 1.0}")
        return await service.reward(episode_id, body["reward"])

    @app.post("/v1/episodes/{episode_id}/cancel")
    async def cancel(episode_id: str):
        return await service.cancel(episode_id)

    @app.get("/v1/episodes/{episode_id}")
    async def trajectory(episode_id: str):
        return service.trajectory(episode_id)

    return Guard(app, service.api_key, service.max_requests, service.max_request_bytes)


async def _refuse(scope, receive, send, err: ServiceError, headers: dict) -> None:
    await JSONResponse(err.body(), status_code=err.status, headers=headers)(scope, receive, send)


class Guard:
    """Pure ASGI, in front of the app; for each request, in order:
    - an open route (GET /health) is served, when the request has no body;
    - the key, from the headers alone: without it, 401 and the connection closed (uvicorn then
      reads no more of it), before any byte of the body is read;
    - at most `max_requests` keyed requests at once: past it 503 at once (Retry-After: 1);
    - the body, read by BodyLimit (at most `max_body` bytes) and handed to the app."""

    def __init__(self, app, key: str, max_requests: int, max_body: int):
        self.app, self.limited = app, BodyLimit(app, max_body)
        self.digest = hashlib.sha256(key.encode()).digest()
        self.max_requests, self.active = max_requests, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, send)
        if scope["type"] != "http":          # no websocket routes: closed (403) before anything is read
            return await send({"type": "websocket.close", "code": 1008})
        headers = dict(scope.get("headers") or [])
        if (scope["method"], scope["path"]) in OPEN and not _has_body(headers):
            return await self.app(scope, receive, send)
        if not authorized(headers.get(b"authorization", b"").decode("latin-1"), self.digest):
            err = ServiceError(401, "missing or wrong API key: send Authorization: Bearer <service.api_key>",
                               "invalid_api_key")
            return await _refuse(scope, receive, send, err, {"Connection": "close"})
        if self.active >= self.max_requests:
            err = ServiceError(503, f"the service is serving service.max_requests={self.max_requests} requests "
                                    f"at once: send it again shortly", "too_many_requests")
            return await _refuse(scope, receive, send, err, {"Retry-After": "1"})
        self.active += 1
        try:
            await self.limited(scope, receive, send)
        finally:
            self.active -= 1


def _has_body(headers: dict) -> bool:
    return headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers


class BodyLimit:
    """ASGI wrapper: a request whose body is larger than `limit` bytes gets 413 (OpenAI's error
    shape) before the app sees it: at once when its Content-Length says so, else once the bytes
    that arrived pass it. The body (at most `limit` bytes) is read here, then handed to the app."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def _refuse(self, scope, receive, send) -> None:
        err = ServiceError(413, f"the request body is larger than service.max_request_mb="
                                f"{self.limit / (1 << 20):g} MiB", "request_too_large")
        await JSONResponse(err.body(), status_code=413, headers={"Connection": "close"})(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":          # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(scope, receive, send)
            if not message.get("more_body", False):
                break
        body = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return body.pop() if body else await receive()
        await self.app(scope, replay, send)
