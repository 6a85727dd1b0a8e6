"""How many tokens each request held by a paused engine has generated, from the engine itself.

The pause contract (engine.py): once `pause()` returned, `partial(key)` of a held request is
every token it has produced. The engine stops producing when the pause takes hold, but what it
produced last is still on its way to the client: through vLLM's output processor, the stream
and the network. How long that takes depends on the machine (a loaded CPU, a server that the
kernel schedules behind its own engine threads), so the client does not guess it from a quiet
stream: it asks the engine core how many tokens each held request has, and waits until it
holds exactly that many (`wait_for_held`). Tokens stamped after that wait come after resume().

Three pieces, each in the process it runs in:
- `megarl_held_tokens`, a utility method megarl adds to vLLM's EngineCore (installed by the
  vLLM plugin, `rollout/engines/plugin.py`, in every vLLM process): {internal request id: output
  tokens} of every request its scheduler holds. The reply travels on the socket that carries
  the outputs, after every output the core sent before it, so the counts and the outputs agree.
- `held_by_external_id` (in the process that owns vLLM's AsyncLLM: the API server or megarl's
  in-process engine): the counts keyed by the request ids the client chose.
- `HeldTokensRoute`, ASGI middleware of servers megarl starts: `GET /megarl/held_tokens`.

This module stays light: vLLM loads it into every engine process.
"""
from __future__ import annotations

import asyncio
from typing import Callable, Optional

from megarl.rollout.engines import asgi
from megarl.rollout.engines.engine import EngineError

UTILITY = "megarl_held_tokens"
ROUTE = "/megarl/held_tokens"


def _core_held_tokens(core) -> dict[str, int]:
    """EngineCore utility: output tokens of every request the scheduler holds."""
    return {rid: int(req.num_output_tokens) for rid, req in core.scheduler.requests.items()}


def install_core_utility() -> None:
    """Add the utility to vLLM's EngineCore (idempotent; the engine core process calls
    utilities by name, so the method must exist on its class)."""
    from vllm.v1.engine.core import EngineCore
    if not hasattr(EngineCore, UTILITY):
        setattr(EngineCore, UTILITY, _core_held_tokens)


def external_ids(internal: dict[str, int], states: dict) -> dict[str, int]:
    """Counts keyed by the caller's request id: vLLM's output processor maps each internal id
    to the id the caller gave (`external_req_id`); vLLM makes an internal id by appending '-'
    and 8 random characters, which is the fallback for a request the processor has let go."""
    out = {}
    for rid, n in internal.items():
        state = states.get(rid)
        ext = getattr(state, "external_req_id", None) or rid.rsplit("-", 1)[0]
        out[ext] = out.get(ext, 0) + n
    return out


async def held_by_external_id(llm) -> dict[str, int]:
    """{caller's request id: tokens generated} of every request a paused AsyncLLM holds."""
    internal = await llm.engine_core.call_utility_async(UTILITY)
    return external_ids(internal, llm.output_processor.request_states)


async def wait_for_held(counts: dict[str, int], received: Callable[[str], Optional[int]],
                        timeout_s: float, where: str) -> None:
    """Until, for every request id in `counts`, the client holds that many tokens. `received(id)`
    is how many it holds, None when the request is not (or no longer) in flight: it resolved,
    or it is another client's. Raises an EngineError naming the request that is short after
    `timeout_s`, or that holds more than the paused engine produced (the pause did not hold)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        short = []
        for rid, want in counts.items():
            got = received(rid)
            if got is None:
                continue
            if got > want:
                raise EngineError(f"{where}: request {rid} holds {got} tokens, but the paused engine "
                                  f"generated {want}: a token arrived after the pause took hold")
            if got < want:
                short.append((rid, got, want))
        if not short:
            return
        if loop.time() > deadline:
            rid, got, want = short[0]
            raise EngineError(f"{where}: after the pause, request {rid} holds {got} of the {want} tokens "
                              f"the engine generated before it ({len(short)} request(s) short) after "
                              f"{timeout_s:.0f} s (rollout.engines.timeout_s): the stream stalled; see "
                              f"the engine's log")
        await asyncio.sleep(0.005)


class HeldTokensRoute:
    """Pure ASGI middleware of servers megarl starts: `GET /megarl/held_tokens` answers
    {"tokens": {request id: tokens}} of the requests the paused engine holds (409 when the
    engine is not paused: counts of a running engine are out of date as they are read).
    Every other request passes through. Listed before `auth.RequireKey`, which wraps it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = (scope.get("path") or "").removeprefix(scope.get("root_path", ""))
        if scope["type"] != "http" or path != ROUTE:
            return await self.app(scope, receive, send)
        status, body = 200, {}
        try:
            llm = scope["app"].state.engine_client
            if not await llm.is_paused():
                status, body = 409, {"error": "the engine is not paused"}
            else:
                body = {"tokens": await held_by_external_id(llm)}
        except Exception as err:   # the answer names it; the server stays up
            status, body = 500, {"error": f"{type(err).__name__}: {err}"}
        await asgi.send_json(send, status, body)
