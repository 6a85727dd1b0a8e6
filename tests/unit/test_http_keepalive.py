"""The HTTP engine never reuses a connection the server may be closing.

vLLM's server (uvicorn) closes a keep-alive connection after VLLM_HTTP_TIMEOUT_KEEP_ALIVE
(5 s) idle. aiohttp keeps idle connections 15 s by default, so a request sent on a connection
idle for ~5 s races the server's close and fails with ServerDisconnectedError, and the pool
then retires a healthy engine (seen once in CI: the surviving engine of two was retired while
the other one's replacement loaded, and the run stopped with "no rollout engine left").

The race is timing-dependent on a real server; this server makes it certain: a request that
arrives on a connection idle for longer than the server's keep-alive is dropped unanswered,
which is what a client sees when its request meets the server's close.
"""
import asyncio
import time

from megarl.rollout.engines.vllm_http import HTTPVLLMEngine

SERVER_KEEPALIVE_S = 5.0     # vLLM's default VLLM_HTTP_TIMEOUT_KEEP_ALIVE


class RacingServer:
    """Answers every request with `{}` and keeps connections open, except that a request on a
    connection idle longer than SERVER_KEEPALIVE_S gets the connection closed instead."""

    def __init__(self):
        self.connections = 0
        self.dropped = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.connections += 1
        last = time.monotonic()
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                if length:
                    await reader.readexactly(length)
                if time.monotonic() - last > SERVER_KEEPALIVE_S:
                    self.dropped += 1
                    return                           # the close the request raced
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 2\r\n\r\n{}")
                await writer.drain()
                last = time.monotonic()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def with_engine(body):
    """Run `body(engine)` against a fresh RacingServer; returns the server (its counters)."""
    async def main():
        srv = RacingServer()
        server = await asyncio.start_server(srv.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        engine = HTTPVLLMEngine("e0", f"http://127.0.0.1:{port}", api_key="", timeout_s=10)
        engine._open_session()
        try:
            await body(engine)
        finally:
            await engine.close()
            server.close()
            await server.wait_closed()
        return srv

    return asyncio.run(main())


def test_a_connection_idle_past_the_servers_keepalive_is_not_reused():
    async def body(engine):
        assert (await engine._call("POST", "/pause?mode=keep"))[0] == 200
        await asyncio.sleep(SERVER_KEEPALIVE_S + 0.5)
        assert (await engine._call("POST", "/resume"))[0] == 200   # EngineError before the fix

    srv = with_engine(body)
    assert srv.dropped == 0
    assert srv.connections == 2          # the idle connection was replaced, not reused


def test_back_to_back_requests_share_one_connection():
    """The keep-alive limit must not turn into one connection per request."""
    async def body(engine):
        for _ in range(5):
            assert (await engine._call("GET", "/health"))[0] == 200

    assert with_engine(body).connections == 1
