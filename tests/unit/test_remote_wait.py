"""A remote engine that does not answer (megarl/rollout/engines/vllm_http.py `_wait_healthy`): the
wait is said every few seconds, and the error names the URL and rollout.engines.urls, exit 2."""
import asyncio
import socket

import pytest

from megarl.rollout.engines.engine import EngineError
from megarl.rollout.engines.vllm_http import HTTPVLLMEngine


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(url: str, timeout_s: float):
    async def main():
        engine = HTTPVLLMEngine("engine0", url, api_key="", timeout_s=10, start_timeout_s=timeout_s)
        try:
            await engine.start()
        finally:
            await engine.close()
    asyncio.run(main())


def test_nothing_listening_is_said_while_waiting_and_named_at_the_end(capsys):
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(EngineError) as e:
        _start(url, 12)
    msg = str(e.value)
    assert f"no server answered GET {url}/health within 12 s" in msg and "rollout.engines.urls" in msg
    assert "rollout.engines.start_timeout_s" in msg and "\n" not in msg
    assert e.value.exit_code == 2   # a remote URL is the user's input (megarl/cli.py exits 2)
    waits = [line for line in capsys.readouterr().err.splitlines() if line.startswith("megarl: waiting for engine")]
    assert waits and all(url in line and "rollout.engines.urls" in line for line in waits)


def test_a_server_without_health_is_not_waited_for():
    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        engine = HTTPVLLMEngine("engine0", url, api_key="", timeout_s=10, start_timeout_s=600)
        try:
            await asyncio.wait_for(engine.start(), 30)   # at once, not after 600 s
        finally:
            await engine.close()
            server.close()
        return url

    with pytest.raises(EngineError,
                       match=r"/health answers HTTP 404: that is not a vLLM server.*rollout\.engines\.urls") as e:
        asyncio.run(main())
    assert e.value.exit_code == 2
