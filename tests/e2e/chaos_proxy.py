"""A reverse proxy on 127.0.0.1 in front of one vLLM server, in a thread of its own, that
misbehaves on cue and records every /v1/completions stream it relays (tests/e2e/test_chaos.py).

- `fail_first=True`: the first /v1/completions is answered HTTP 500 with vLLM's error body, and
  not forwarded (a server that fails one request and is healthy otherwise).
- `on_first_token=fn`: when the first stream carries its first token through, fn() is called
  (the test SIGKILLs the server there) and every stream in flight then stops being relayed:
  each ends without [DONE] holding exactly the tokens it relayed so far, as a client sees a
  server die, whatever the server had in its socket buffers at that moment. A kill at a moment
  the test picks ("the first token") would otherwise depend on how fast the streams run.
Everything else (health, control and weight-transfer calls) is relayed as is, with the
server's own key when `api_key` is given (remote mode sends one key to every URL); once the
server is gone, calls get HTTP 502 as from a load balancer in front of a dead server.

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
    def __init__(self, upstream: str, fail_first: bool = False, on_first_token: Optional[Callable] = None,
                 api_key: str = ""):
        self.upstream, self.api_key = upstream.rstrip("/"), api_key
        self.fail_first, self.on_first_token = fail_first, on_first_token
        self.streams: list[dict] = []
        self.cut = False                     # on_first_token fired: nothing more is relayed on open streams
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
            upstream = await self.session.request(request.method, self.upstream + request.path_qs,
                                                  data=body, headers=headers)
        except aiohttp.ClientError as err:
            if record is not None:
                record["status"] = 502
            return web.json_response({"error": f"upstream unreachable: {err}"}, status=502)
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
                    if self.cut:
                        break
                    await resp.write(line)
                    if record is not None and self._saw(record, line):
                        break
            except (aiohttp.ClientError, ConnectionError):
                pass                           # the server died (or the client left): the stream ends here
            return resp

    def _saw(self, record: dict, line: bytes) -> bool:
        """Fold one relayed SSE line into `record`; True once the stream must end here (it
        relayed its first token, on which the server is killed)."""
        data = line.strip()[5:].strip() if line.startswith(b"data:") else b""
        if data == b"[DONE]":
            record["done"] = True
        if not data or data == b"[DONE]":
            return False
        for choice in json.loads(data).get("choices", ()):
            record["tokens"] += choice.get("token_ids") or []
            record["logprobs"] += (choice.get("logprobs") or {}).get("token_logprobs") or []
            if self.on_first_token is not None and not self.cut and record["tokens"] \
                    and choice.get("finish_reason") is None:
                self.cut = True
                self.on_first_token()
                return True
        return False
