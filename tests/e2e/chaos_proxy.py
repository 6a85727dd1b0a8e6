"""A reverse proxy on 127.0.0.1 in front of one vLLM server, in a thread of its own, that
misbehaves on cue and records every /v1/completions stream it relays (tests/e2e/test_chaos.py).

- `fail_first=True`: the first /v1/completions is answered HTTP 500 with vLLM's error body, and
  not forwarded (a server that fails one request and is healthy otherwise).
- `die_at`: the server dies at the first token a stream relays once the proxy is armed
  (from the start, or `armed_by=(path, n)`: once the n-th call of `path` was relayed, e.g. the
  third weight push). Then `on_death()` runs (the test SIGKILLs the server there), every stream
  in flight stops being relayed, each ending without [DONE] with exactly the tokens it relayed
  so far, and every later call gets HTTP 502, as from a load balancer in front of a dead
  server. The proxy picks the moment (a first token) so that the death lands mid-round
  whatever the speed of the streams.
Everything else (health, control and weight-transfer calls) is relayed as is, with the
server's own key when `api_key` is given (remote mode sends one key to every URL).

`streams`: per relayed completion, {"key", "prompt", "tokens", "logprobs", "status", "done"}
("key": the request's X-Request-Id without megarl's per-client suffix: the pool's request key).
"""
from __future__ import annotations

import asyncio
import json
import threading
from typing import Callable, Optional

import aiohttp
from aiohttp import web

HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}
ERROR_500 = {"error": {"message": "internal server error (chaos proxy)", "type": "InternalServerError",
                       "param": None, "code": 500}}


class ChaosProxy:
    def __init__(self, upstream: str, api_key: str = "", fail_first: bool = False, die: bool = False,
                 armed_by: Optional[tuple[str, int]] = None, on_death: Optional[Callable] = None):
        self.upstream, self.api_key = upstream.rstrip("/"), api_key
        self.fail_first, self.on_death = fail_first, on_death
        self.armed_by = armed_by
        self.armed = die and armed_by is None
        self.calls: dict[str, int] = {}        # path -> calls relayed
        self.streams: list[dict] = []
        self.dead = False                      # nothing is relayed any more
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="chaos-proxy", daemon=True)
        self.url = ""

    def start(self) -> "ChaosProxy":
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(60)
        return self

    async def _start(self) -> str:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._relay)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        async def stop():
            await self.runner.cleanup()
            await self.session.close()
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(60)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)

    async def _relay(self, request: web.Request):
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        if self.api_key and "Authorization" in headers:
            headers["Authorization"] = f"Bearer {self.api_key}"
        record = None
        if request.method == "POST" and request.path == "/v1/completions":
            rid = request.headers.get("X-Request-Id", "")
            record = {"key": rid.rsplit("-", 1)[0], "prompt": json.loads(body).get("prompt"), "tokens": [],
                      "logprobs": [], "status": None, "done": False}
            self.streams.append(record)
            if self.fail_first and len(self.streams) == 1:
                record["status"] = 500
                return web.json_response(ERROR_500, status=500)
        try:
            if self.dead:
                raise aiohttp.ClientConnectionError("the server is dead")
            upstream = await self.session.request(request.method, self.upstream + request.path_qs,
                                                  data=body, headers=headers)
        except aiohttp.ClientError as err:
            if record is not None:
                record["status"] = 502
            return web.json_response({"error": f"upstream unreachable: {err}"}, status=502)
        self.calls[request.path] = self.calls.get(request.path, 0) + 1
        if self.armed_by is not None and self.calls.get(self.armed_by[0]) == self.armed_by[1]:
            self.armed = True
        async with upstream:
            if record is not None:
                record["status"] = upstream.status
            if not upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
                return web.Response(body=await upstream.read(), status=upstream.status,
                                    content_type=upstream.content_type)
            resp = web.StreamResponse(status=upstream.status, headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            try:
                async for line in upstream.content:
                    if self.dead:
                        break
                    await resp.write(line)
                    if record is not None and self._saw(record, line):
                        break
            except (aiohttp.ClientError, ConnectionError):
                pass                           # the server died (or the client left): the stream ends here
            return resp

    def _saw(self, record: dict, line: bytes) -> bool:
        """Fold one relayed SSE line into `record`; True once the server dies on it (the first
        token relayed while armed)."""
        data = line.strip()[5:].strip() if line.startswith(b"data:") else b""
        if data == b"[DONE]":
            record["done"] = True
        if not data or data == b"[DONE]":
            return False
        for choice in json.loads(data).get("choices", ()):
            record["tokens"] += choice.get("token_ids") or []
            record["logprobs"] += (choice.get("logprobs") or {}).get("token_logprobs") or []
            if self.armed and not self.dead and record["tokens"] and choice.get("finish_reason") is None:
                self.dead = True
                if self.on_death is not None:
                    self.on_death()
                return True
        return False
