"""An engine that answers it failed a request (a server's HTTP 5xx: `ServerError`) is up and
said so: the pool asks its health and, when it answers, sends the request to it once more,
from the tokens it had streamed, before it retires it. One such answer never costs the run a
healthy engine; a second one for the same request, or a health check that fails, retires it
as before and the request continues elsewhere (scripted engines on a deterministic clock, and
the HTTP engine against a small server that answers 500 as vLLM does)."""
import asyncio
import json

from aiohttp import web
from scripted_engine import ScriptedEngine, assert_whole, run_on_clock

from megarl.rollout.controller.sync_rollout import generate_groups
from megarl.rollout.engines.engine import EngineError, EngineHealth, GenRequest, ServerError
from megarl.rollout.engines.pool import EnginePool
from megarl.rollout.engines.vllm_http import HTTPVLLMEngine

LENGTH = 40


class AnswersServerErrors(ScriptedEngine):
    """Answers `answers` requests (every one: None) with a ServerError after `after` tokens,
    carrying them as its partial; `alive`: what its health check says."""

    def __init__(self, name, clock, answers=1, after=5, alive=True):
        super().__init__(name, clock)
        self.answers, self.after, self.alive = answers, after, alive
        self.answered_5xx: list[str] = []

    async def generate(self, req):
        if self.answers is None or len(self.answered_5xx) < self.answers:
            self.answered_5xx.append(req.key)
            cut = GenRequest(req.key, req.prompt_ids, min(self.after, req.max_tokens), req.temperature)
            part = await super().generate(cut)
            raise ServerError(f"engine {self.name}: request {req.key} -> HTTP 500: internal error", partial=part)
        return await super().generate(req)

    async def health(self):
        return EngineHealth(self.name, self.alive, self.paused, self.running, self.version)


def _whole(result):
    assert_whole(result.token_ids, result.logprobs, result.finish_reason, LENGTH)


def test_one_server_error_is_retried_on_the_same_engine_and_nothing_is_retired():
    async def main(clock):
        flaky, other = AnswersServerErrors("e0", clock, answers=1), ScriptedEngine("e1", clock)
        pool = EnginePool([flaky, other], 30, failures_max=0)
        result = await pool.generate(GenRequest("k", [0, 0, LENGTH], 64), flaky)
        return pool, flaky, other, result
    pool, flaky, other, result = run_on_clock(main)
    _whole(result)
    assert result.engine == "e0" and other.served == 0        # served where it was, from its 5 tokens
    assert pool.failures == [] and pool.engines == [flaky, other] and pool.retries == 1


def test_each_request_gets_its_own_retry_in_a_sync_rollout():
    """Two of e0's requests answered 500 once each: both retried there, every sample whole."""
    async def main(clock):
        flaky, other = AnswersServerErrors("e0", clock, answers=2), ScriptedEngine("e1", clock)
        pool = EnginePool([flaky, other], 30, failures_max=0)
        prompts = [[g, 0, LENGTH] for g in range(4)]
        samples = await generate_groups(pool, [{} for _ in prompts], prompts, 2, 64)
        return pool, flaky, samples
    pool, flaky, samples = run_on_clock(main)
    assert len(flaky.answered_5xx) == 2 and len(set(flaky.answered_5xx)) == 2
    assert pool.failures == [] and len(pool.engines) == 2 and pool.retries == 2
    for s in samples:
        assert_whole(s.response_ids, s.logprobs, s.finish_reason, LENGTH)


def test_a_second_server_error_for_the_request_retires_the_engine():
    async def main(clock):
        broken, other = AnswersServerErrors("e0", clock, answers=None, after=3), ScriptedEngine("e1", clock)
        pool = EnginePool([broken, other], 30, failures_max=1)
        result = await pool.generate(GenRequest("k", [0, 0, LENGTH], 64), broken)
        return pool, broken, result
    pool, broken, result = run_on_clock(main)
    _whole(result)                                              # 3 + 3 tokens on e0, the rest on e1
    assert result.engine == "e1" and broken.answered_5xx == ["k", "k"]
    assert [e.name for e in pool.retired] == ["e0"] and len(pool.failures) == 1
    assert "HTTP 500" in pool.failures[0]["error"]


def test_a_server_error_from_an_engine_that_fails_its_health_check_retires_it_at_once():
    async def main(clock):
        dying, other = AnswersServerErrors("e0", clock, answers=1, alive=False), ScriptedEngine("e1", clock)
        pool = EnginePool([dying, other], 30, failures_max=1)
        result = await pool.generate(GenRequest("k", [0, 0, LENGTH], 64), dying)
        return pool, dying, result
    pool, dying, result = run_on_clock(main)
    _whole(result)
    assert result.engine == "e1" and dying.served == 1 and pool.retries == 0
    assert [e.name for e in pool.retired] == ["e0"]


def test_other_engine_errors_still_retire_at_once():
    """A lost connection or a silence is not an answer: no health check, no second try."""
    class LosesConnection(ScriptedEngine):
        async def generate(self, req):
            if not self.served:
                self.served += 1
                raise EngineError(f"engine {self.name}: connection lost during request {req.key}")
            return await super().generate(req)

    async def main(clock):
        lost, other = LosesConnection("e0", clock), ScriptedEngine("e1", clock)
        pool = EnginePool([lost, other], 30, failures_max=1)
        result = await pool.generate(GenRequest("k", [0, 0, LENGTH], 64), lost)
        return pool, result
    pool, result = run_on_clock(main)
    _whole(result)
    assert result.engine == "e1" and [e.name for e in pool.retired] == ["e0"] and pool.retries == 0


class FlakyServer:
    """/health, /v1/models, /is_paused as vLLM serves them; /v1/completions by call: 1 -> HTTP
    500 (vLLM's error body); 2 -> token 7, stop; 3 -> token 8, then an error chunk of code 500;
    4 -> token 9, stop."""
    ERROR = {"error": {"message": "internal error", "type": "InternalServerError", "param": None, "code": 500}}

    def __init__(self):
        self.calls: list[list[int]] = []

    async def completions(self, request):
        self.calls.append(list((await request.json())["prompt"]))
        call = len(self.calls)
        if call == 1:
            return web.json_response(self.ERROR, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        token = {2: 7, 3: 8, 4: 9}[call]
        chunk = {"choices": [{"token_ids": [token], "logprobs": {"token_logprobs": [-0.5]},
                              "finish_reason": None if call == 3 else "stop"}]}
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if call == 3:
            await resp.write(f"data: {json.dumps(self.ERROR)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def app(self):
        app = web.Application()
        app.router.add_get("/health", lambda r: web.json_response({}))
        app.router.add_get("/v1/models", lambda r: web.json_response({"data": [{"id": "m", "max_model_len": 256}]}))
        app.router.add_get("/is_paused", lambda r: web.json_response({"is_paused": False}))
        app.router.add_post("/v1/completions", self.completions)
        return app


def test_the_http_engine_answers_server_errors_and_the_pool_retries_them_there():
    """An HTTP 500 answer, and an error chunk of code 500 after a token: each a ServerError (the
    second carrying that token), each request retried once on the only engine, none retired."""
    server = FlakyServer()

    async def main():
        runner = web.AppRunner(server.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        engine = HTTPVLLMEngine("e0", f"http://127.0.0.1:{port}", "", 10)
        try:
            await engine.start()
            pool = EnginePool([engine], 10, failures_max=0)
            a = await pool.generate(GenRequest("a", [1, 2], 8))
            b = await pool.generate(GenRequest("b", [3, 4], 8))
            return pool, a, b
        finally:
            await engine.close()
            await runner.cleanup()
    pool, a, b = asyncio.run(main())
    assert server.calls == [[1, 2], [1, 2], [3, 4], [3, 4, 8]]    # b continued from its streamed token
    assert (a.token_ids, a.finish_reason) == ([7], "stop") and (b.token_ids, b.finish_reason) == ([8, 9], "stop")
    assert pool.failures == [] and pool.retries == 2
