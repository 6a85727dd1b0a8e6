"""A request's error is never an engine failure (scripted engines, a fake AsyncLLM, a fake
vLLM HTTP server).

vLLM refuses some requests as invalid: a prompt longer than max_model_len, token ids outside
the vocabulary, sampling options out of range. Each engine kind says so with `RequestError`
(not an `EngineError`): the pool never retires an engine or retries elsewhere for it, and each
caller answers it: sync rollout scores the refused samples 0 (the run goes on; a step whose
every sample was refused stops with the engine's message), the weight-sync verify probe
leaves the refused prompts out. The agent service's answers are in test_service_limits.py;
real engines in tests/e2e/test_request_errors.py.
"""
import asyncio
import json
from types import SimpleNamespace

import pytest
from aiohttp import web
from scripted_engine import Clock, ScriptedEngine, assert_whole, run_on_clock

from megarl.rewards import RewardRunner, VerifierEntry
from megarl.rollout.controller.scoring import score_all
from megarl.rollout.controller.sync_rollout import REFUSED, generate_groups
from megarl.rollout.engines import vllm_async
from megarl.rollout.engines.engine import EngineError, GenRequest, RequestError
from megarl.rollout.engines.pool import EnginePool, LoopThread, SyncPool
from megarl.rollout.engines.vllm_async import AsyncVLLMEngine
from megarl.rollout.engines.vllm_http import HTTPVLLMEngine
from megarl.rollout.weights import sync as weight_sync

LENGTH = 12
TOO_LONG = "The decoder prompt (length 300) is longer than the maximum model length of 256."


def refuse_group(gid):
    return lambda req: TOO_LONG if req.prompt_ids[0] == gid else None


# -- the pool --------------------------------------------------------------------------------
def test_the_pool_hands_a_request_error_back_and_retires_nothing():
    async def main(clock):
        engines = [ScriptedEngine("e0", clock, refuse=refuse_group(1)), ScriptedEngine("e1", clock)]
        pool = EnginePool(engines, 30, failures_max=0)
        with pytest.raises(RequestError, match="maximum model length") as err:
            await pool.generate(GenRequest("k", [1, 0, LENGTH], 64), engines[0])
        ok = await pool.generate(GenRequest("k2", [2, 0, LENGTH], 64), engines[0])
        return pool, engines, err.value, ok
    pool, engines, err, ok = run_on_clock(main)
    assert err.key == "k" and not isinstance(err, EngineError)
    assert pool.failures == [] and pool.engines == engines
    assert engines[1].served == 0, "a refused request was retried on another engine"
    assert ok.finish_reason == "stop" and len(ok.token_ids) == LENGTH


# -- sync rollout ----------------------------------------------------------------------------
def test_sync_rollout_scores_refused_samples_zero_and_the_others_come_out_whole():
    async def main(clock):
        pool = EnginePool([ScriptedEngine(f"e{i}", clock, refuse=refuse_group(1)) for i in range(2)], 30)
        prompts = [[g, 0, LENGTH] for g in range(3)]
        return pool, await generate_groups(pool, [{"g": g} for g in range(3)], prompts, 2, 64)
    pool, samples = run_on_clock(main)
    assert pool.failures == [] and len(pool.engines) == 2
    refused = [s for s in samples if s.finish_reason == REFUSED]
    assert [s.group for s in refused] == [1, 1]
    assert all(s.response_ids == [] and s.logprobs == [] and not s.stopped for s in refused)
    for s in samples:
        if s.group != 1:
            assert_whole(s.response_ids, s.logprobs, s.finish_reason, LENGTH)
    scored = []
    reward = RewardRunner(VerifierEntry(lambda *a, **k: scored.append(a) or 1.0, False, False), timeout_s=30)
    try:
        score_all(samples, SimpleNamespace(decode=lambda ids, **k: str(ids)), reward)
    finally:
        reward.close()
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert len(scored) == 4, "the verifier was asked to score a refused sample"


def test_sync_rollout_stops_with_the_engines_message_when_every_sample_is_refused():
    async def main(clock):
        pool = EnginePool([ScriptedEngine("e0", clock, refuse=lambda req: TOO_LONG)], 30)
        await generate_groups(pool, [{}], [[0, 0, LENGTH]], 2, 64)
    with pytest.raises(RequestError, match=r"every sample .* refused.*maximum model length"):
        run_on_clock(main)


# -- the weight-sync verify probe ------------------------------------------------------------
@pytest.fixture
def scripted_sync_pool():
    made = []

    def make(refuse):
        loop = LoopThread("test-request-errors")
        clock = Clock()

        async def start():
            clock.start()
        loop.run(start(), 10)
        pool = EnginePool([ScriptedEngine(f"e{i}", clock, refuse=refuse) for i in range(2)], 30)
        made.append((SyncPool(pool, loop, 10), clock))
        return made[-1][0]
    yield make
    for sp, clock in made:
        sp.loop.run(asyncio.sleep(0), 10)
        clock.stop()
        sp.close()


def test_the_verify_probe_leaves_refused_prompts_out(scripted_sync_pool):
    sp = scripted_sync_pool(refuse_group(1))
    probes = weight_sync.probe_engines(sp, [[0, 0, LENGTH], [1, 0, LENGTH], [2, 0, LENGTH]], 8, 1.0)
    assert sorted(probes) == ["e0", "e1"]
    for samples in probes.values():
        assert [s.prompt_ids[0] for s in samples] == [0, 2]
        assert all(len(s.response_ids) == 8 for s in samples)
    assert sp.pool.failures == []


def test_the_verify_probe_names_an_engine_that_refused_every_prompt(scripted_sync_pool):
    sp = scripted_sync_pool(lambda req: TOO_LONG)
    with pytest.raises(weight_sync.WeightSyncError,
                       match=r"e0 refused every .*maximum model length.*weight_sync.verify"):
        weight_sync.probe_engines(sp, [[0, 0, LENGTH]], 8, 1.0)
    assert sp.pool.failures == []


# -- the in-process engine: vLLM's own validation errors ------------------------------------
class _RefusingAsyncLLM:
    """AsyncLLM.generate as vLLM answers an invalid request: it raises before any output."""

    def __init__(self, error):
        self.error = error

    async def generate(self, prompt, params, request_id, lora_request=None):
        raise self.error
        yield  # an async generator, as vLLM's

    async def abort(self, rids):
        pass


def _vllm_errors():
    from vllm.exceptions import VLLMValidationError
    return [VLLMValidationError(TOO_LONG),
            VLLMValidationError("Token id 99999 is out of vocabulary", parameter="prompt_token_ids"),
            VLLMValidationError("top_p must be in (0, 1], got 0.", parameter="top_p", value=0)]


@pytest.mark.parametrize("index", [0, 1, 2], ids=["too_long", "bad_token_id", "bad_sampling"])
def test_the_in_process_engine_says_request_error_for_vllms_validation_errors(monkeypatch, index):
    monkeypatch.setattr(vllm_async, "sampling_params", lambda req: None)
    error = _vllm_errors()[index]
    engine = AsyncVLLMEngine("e0", "/m", {}, timeout_s=30)
    engine.llm = _RefusingAsyncLLM(error)
    with pytest.raises(RequestError) as caught:
        asyncio.run(engine.generate(GenRequest("k", [1, 2], 8)))
    assert str(error).split(" (parameter")[0] in str(caught.value) and caught.value.key == "k"
    assert "engine e0" in str(caught.value) and engine.running == 0


def test_the_in_process_engine_keeps_engine_errors_for_a_dead_engine(monkeypatch):
    from vllm.v1.engine.exceptions import EngineDeadError
    monkeypatch.setattr(vllm_async, "sampling_params", lambda req: None)
    engine = AsyncVLLMEngine("e0", "/m", {}, timeout_s=30)
    engine.llm = _RefusingAsyncLLM(EngineDeadError())
    with pytest.raises(EngineError):
        asyncio.run(engine.generate(GenRequest("k", [1, 2], 8)))


# -- the HTTP engine: 400 / 422 answers and error chunks of /v1/completions -----------------
class FakeVLLMServer:
    """/health, /v1/models, /is_paused as vLLM serves them; /v1/completions answers by the
    prompt's first id: 1 -> 400 (vLLM's error body), 2 -> 422 (request validation), 3 -> an
    error chunk in the stream with code 400, 4 -> 500, else one token and [DONE]."""

    def __init__(self, max_model_len=256):
        self.max_model_len, self.completions = max_model_len, 0

    async def completions_route(self, request):
        body = await request.json()
        self.completions += 1
        first = body["prompt"][0]
        if first == 1:
            return web.json_response({"error": {"message": TOO_LONG, "type": "BadRequestError", "param": None,
                                                "code": 400}}, status=400)
        if first == 2:
            return web.json_response({"detail": [{"loc": ["body", "top_p"], "msg": "Input should be <= 1"}]},
                                     status=422)
        if first == 4:
            return web.json_response({"error": {"message": "EngineCore died", "type": "InternalServerError",
                                                "param": None, "code": 500}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if first == 3:
            err = {"error": {"message": "Token id 99999 is out of vocabulary", "type": "BadRequestError",
                             "param": None, "code": 400}}
            await resp.write(f"data: {json.dumps(err)}\n\n".encode())
        else:
            chunk = {"choices": [{"token_ids": [7], "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "stop"}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def app(self):
        app = web.Application()
        app.router.add_get("/health", lambda r: web.json_response({}))
        app.router.add_get("/v1/models", lambda r: web.json_response(
            {"data": [{"id": "m", "max_model_len": self.max_model_len}]}))
        app.router.add_get("/is_paused", lambda r: web.json_response({"is_paused": False}))
        app.router.add_post("/v1/completions", self.completions_route)
        return app


def _with_http_engine(body, server=None, **engine_kw):
    server = server or FakeVLLMServer()

    async def main():
        runner = web.AppRunner(server.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        engine = HTTPVLLMEngine("e0", f"http://127.0.0.1:{port}", "", 10, log_path="/logs/engine_0.log", **engine_kw)
        try:
            return await body(engine)
        finally:
            await engine.close()
            await runner.cleanup()
    return asyncio.run(main())


@pytest.mark.parametrize("first, words", [(1, "maximum model length"), (2, "top_p"), (3, "out of vocabulary")],
                         ids=["http_400", "http_422", "error_chunk_400"])
def test_the_http_engine_says_request_error_for_a_refused_request(first, words):
    async def body(engine):
        await engine.start()
        pool = EnginePool([engine], 10, failures_max=0)
        with pytest.raises(RequestError, match=words) as caught:
            await pool.generate(GenRequest("k", [first, 5], 8))
        ok = await pool.generate(GenRequest("k2", [9, 5], 8))
        return pool, caught.value, ok
    pool, err, ok = _with_http_engine(body)
    assert pool.failures == [] and len(pool.engines) == 1 and ok.token_ids == [7]
    assert err.key == "k" and "http://" not in str(err) and "/logs/" not in str(err)


def test_the_http_engine_keeps_engine_errors_for_a_server_error():
    async def body(engine):
        await engine.start()
        with pytest.raises(EngineError, match="HTTP 500"):
            await engine.generate(GenRequest("k", [4, 5], 8))
    _with_http_engine(body)


# -- start checks ----------------------------------------------------------------------------
def test_a_remote_server_with_a_shorter_context_is_refused_at_start():
    async def body(engine):
        with pytest.raises(EngineError) as caught:
            await engine.start()
        return caught.value
    err = _with_http_engine(body, FakeVLLMServer(max_model_len=128), max_model_len=256)
    assert getattr(err, "exit_code", 1) == 2
    assert "max_model_len=128" in str(err) and "rollout.engines.max_model_len=256" in str(err)
    ok = _with_http_engine(lambda e: e.start(), FakeVLLMServer(max_model_len=256), max_model_len=256)
    assert ok is None


def test_the_engine_count_must_match_the_urls_in_remote_mode():
    from megarl.config import ConfigError, load_config
    urls = "rollout.engines.urls=[http://a:8000,http://b:8000]"
    with pytest.raises(ConfigError, match=r"rollout.engines.count=3.*rollout.engines.urls"):
        load_config("recipes/tiny_cpu.yaml", ["rollout.engines.mode=remote", urls, "rollout.engines.count=3"])
    cfg = load_config("recipes/tiny_cpu.yaml", ["rollout.engines.mode=remote", urls, "rollout.engines.count=2"])
    assert cfg.rollout.engines.pool_size == 2
    assert load_config("recipes/tiny_cpu.yaml", ["rollout.engines.mode=remote", urls]).rollout.engines.pool_size == 2

