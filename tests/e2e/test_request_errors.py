"""Requests real vLLM engines refuse as invalid are the requests' errors, on both engine kinds:
a vLLM server (HTTP, the session's shared server of tests/conftest.py) and an in-process
engine (AsyncLLM, in a fresh process). Each kind of refusal (a prompt longer than
max_model_len, token ids outside the vocabulary, top_p and temperature out of range) comes
back as a RequestError naming the request, the engine serves the next request, and nothing is
retired; sync rollout scores the refused group's samples as refused while the other trains;
the verify probe leaves the refused prompt out; an agent gets HTTP 400 with vLLM's message
(and no engine address or log path), then its next call is served
(tests/e2e/request_error_checks.py runs the cases)."""
import json

import pytest
import request_error_checks
from conftest import run_py

from megarl.preflight import load_tokenizer, read_hf_config
from megarl.rollout.engines.pool import EnginePool, LoopThread, SyncPool
from megarl.rollout.engines.vllm_http import HTTPVLLMEngine

SERVER_MAX_MODEL_LEN = 256      # the remote_engine fixture's
# what the refusal names: vLLM's validation (in-process) or the server's request schema (HTTP)
REFUSALS = {"too_long": ("maximum",), "bad_token_id": ("vocabulary",),
            "negative_token_id": ("vocabulary", "greater_than_equal"), "bad_top_p": ("top_p",),
            "bad_temperature": ("temperature",)}


def check(seen: dict, where: str) -> None:
    for name, words in REFUSALS.items():
        case = seen["cases"][name]
        assert case["request_error"], (where, name, case)
        assert case["key"] == name and any(w in case["message"].lower() for w in words), (where, name, case)
        assert case["then"]["error"] is None and case["then"]["tokens"] > 0, (where, name, case)
    assert seen["failures"] == [] and all(seen["engines_alive"]), (where, seen["failures"])
    by_group = {g: [s for s in seen["rollout"] if s["group"] == g] for g in (0, 1)}
    assert all(s["finish_reason"] == "refused" and s["tokens"] == 0 for s in by_group[1]), (where, seen["rollout"])
    assert all(s["finish_reason"] in ("stop", "length") and s["tokens"] > 0 for s in by_group[0]), where
    assert list(seen["probe"].values()) == [[len(request_error_checks.GOOD)]], (where, seen["probe"])
    refused, short = seen["service"]["too_long"], seen["service"]["short"]
    assert refused["status"] == 400, (where, refused)
    message = json.loads(refused["body"])["error"]["message"]
    assert "refused this call" in message and "maximum" in message.lower(), (where, message)
    assert "http://" not in refused["body"] and ".log" not in refused["body"], (where, refused)
    assert short["status"] == 200, (where, short)


def test_an_http_engine_answers_refusals_as_the_requests_errors(tiny_model, remote_engine):
    loop = LoopThread("test-request-errors-http")
    engine = HTTPVLLMEngine("engine0", remote_engine.server.url, remote_engine.server.api_key, 120,
                            log_path=str(remote_engine.server.log_path), max_model_len=SERVER_MAX_MODEL_LEN)
    sp = SyncPool(EnginePool([engine], 120, failures_max=0), loop, 600)
    try:
        # the server may hold a paused state or older weights from other runs: generation is all we need
        sp.call(engine.resume(), "resuming the shared server")
        seen = request_error_checks.observe(sp, load_tokenizer(str(tiny_model)), SERVER_MAX_MODEL_LEN,
                                            read_hf_config(str(tiny_model))["vocab_size"])
    finally:
        sp.close()
    check(seen, "http")


def test_an_http_engine_with_a_shorter_context_is_refused_at_start(remote_engine):
    """The shared server serves 256 positions: a run asking for more is told at start (exit 2)."""
    loop = LoopThread("test-request-errors-start")
    engine = HTTPVLLMEngine("engine0", remote_engine.server.url, remote_engine.server.api_key, 60,
                            max_model_len=2 * SERVER_MAX_MODEL_LEN)
    try:
        with pytest.raises(Exception) as caught:
            loop.run(EnginePool([engine], 60).start(), 120)
    finally:
        loop.stop()
    assert getattr(caught.value, "exit_code", None) == 2, caught.value
    assert f"max_model_len={SERVER_MAX_MODEL_LEN}" in str(caught.value)
    assert f"rollout.engines.max_model_len={2 * SERVER_MAX_MODEL_LEN}" in str(caught.value)


def test_an_in_process_engine_answers_refusals_as_the_requests_errors(tiny_model, tmp_path):
    out = tmp_path / "seen.json"
    proc = run_py(["tests/e2e/request_error_probe.py", str(tiny_model), str(out), str(tmp_path / "logs")],
                  timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    check(json.loads(out.read_text()), "in-process")
