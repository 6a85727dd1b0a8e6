"""held_tokens.py's pure parts: the ids a paused engine's counts are keyed by, and the client's
wait until it holds each held request's tokens (the e2e check is in test_http_engine.py)."""
import asyncio
from types import SimpleNamespace

import pytest

from megarl.rollout.engines.engine import EngineError
from megarl.rollout.engines.held_tokens import external_ids, wait_for_held


def test_counts_are_keyed_by_the_callers_ids():
    states = {"cmpl-a-0-1f2e3d4c": SimpleNamespace(external_req_id="cmpl-a-0")}
    # the processor's id where it has the request, else vLLM's suffix dropped
    assert external_ids({"cmpl-a-0-1f2e3d4c": 5, "k#3-9a8b7c6d": 2}, states) == {"cmpl-a-0": 5, "k#3": 2}


def test_the_wait_returns_once_every_held_request_has_its_tokens():
    held = {"a": 1, "b": 4}

    async def main():
        async def arrive():
            for _ in range(3):
                await asyncio.sleep(0.01)
                held["a"] += 1
        task = asyncio.create_task(arrive())
        # "gone" resolved meanwhile (None): not waited for; "c" is another client's
        await wait_for_held({"a": 4, "b": 4, "gone": 9, "c": 2}, lambda k: held.get(k), 30, "engine e0")
        await task
    asyncio.run(main())
    assert held == {"a": 4, "b": 4}


def test_a_short_stream_past_the_deadline_is_a_named_engine_error():
    with pytest.raises(EngineError, match=r"engine e0: after the pause, request a holds 1 of the 3 tokens"):
        asyncio.run(wait_for_held({"a": 3}, lambda k: 1, 0.05, "engine e0"))


def test_a_token_after_the_pause_is_an_engine_error():
    with pytest.raises(EngineError, match=r"request a holds 4 tokens, but the paused engine generated 3"):
        asyncio.run(wait_for_held({"a": 3}, lambda k: 4, 30, "engine e0"))
