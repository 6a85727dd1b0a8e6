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
drawn at the run's temperature with top_p=1 and no penalties, so a request asking otherwise is
refused (400) instead of quietly served differently. Errors use OpenAI's shape
{"error": {"message", "type", "code", "param"}}, so agents' clients raise their usual errors;
an engine failure (503) or an internal error (500) says what happened without the engines'
addresses or log paths, which go to the trainer's log. A body larger than service.max_request_mb
is refused (413) as it arrives, whether its Content-Length says so or not.
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


def chat_options(body: dict, temperature: float) -> tuple[int | None, bool]:
    """Check a chat request's sampling options against the run's; (max_tokens, logprobs)."""
    if body.get("stream"):
        raise ServiceError(400, "stream=true is not supported: the service answers whole completions "
                                "(send stream=false or leave it out)")
    n = _number(body, "n")
    if n is not None and n != 1:
        raise ServiceError(400, f"n={n}: the service generates one completion per call (an episode is one "
                                f"sample; the group's other samples are other episodes)")
    top_p = _number(body, "top_p")
    if top_p is not None and top_p != 1:
        raise ServiceError(400, f"top_p={top_p}: the service samples at top_p=1 (the trainer's importance "
                                f"ratios assume it); leave top_p out")
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
    """The FastAPI app serving `service` (an AgentService); its key is checked on every route
    but /health."""
    digest = hashlib.sha256(service.api_key.encode()).digest()
    app = FastAPI(title="megarl agent service", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def require_key(request: Request, call_next):
        if (request.method, request.url.path) in OPEN or authorized(request.headers.get("authorization", ""), digest):
            return await call_next(request)
        err = ServiceError(401, "missing or wrong API key: send Authorization: Bearer <service.api_key>",
                           "invalid_api_key")
        return JSONResponse(err.body(), status_code=401)

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
        max_tokens, logprobs = chat_options(body, service.temperature)
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

    return BodyLimit(app, service.max_request_bytes)


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
