"""Every route of a megarl-started vLLM server behind its API key.

vLLM's own `--api-key` check guards only the /v1, /v2, /inference and /cohere prefixes: the
control routes (/pause, /abort_requests, /collective_rpc, /reset_prefix_cache) and the
weight-transfer routes answer anyone who reaches the port, so on a shared cluster network any
user could pause the engines or push weights into them. Servers megarl starts
(`servers.LocalServer`, also under slurm through `megarl.rollout.engines.serve`) load this middleware
with vLLM's `--middleware`; it refuses every request but `GET /health` (the readiness poll,
which reveals nothing) without `Authorization: Bearer <key>`, the key being the server's
$VLLM_API_KEY (kept out of the process list).
"""
from __future__ import annotations

import hashlib
import hmac
import os

from megarl.rollout.engines import asgi

OPEN = {("GET", "/health")}
KEY_ENV = "VLLM_API_KEY"


class RequireKey:
    """Pure ASGI middleware (vLLM adds it with `app.add_middleware(RequireKey)`)."""

    def __init__(self, app):
        key = os.environ.get(KEY_ENV, "")
        if not key:
            # a megarl server without a key would be open to everyone: refuse to start
            raise RuntimeError(f"megarl.rollout.engines.auth.RequireKey: ${KEY_ENV} is empty; a megarl-started "
                               f"server must have an API key (rollout.engines.api_key or $MEGARL_ENGINE_API_KEY)")
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    def allowed(self, method: str, path: str, authorization: str) -> bool:
        if (method, path) in OPEN:
            return True
        scheme, _, token = authorization.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            hashlib.sha256(token.strip().encode()).digest(), self._digest)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.allowed(scope.get("method", "GET"), path, headers.get("authorization", "")):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        await asgi.send_json(send, 401, {"error": "Unauthorized: this megarl engine needs its API key"})
