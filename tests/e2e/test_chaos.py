"""Chaos on real engines: a sync-mode `megarl train` on two vLLM servers (remote mode: the
session's shared server of tests/conftest.py and one this file starts), each behind a proxy
(chaos_proxy.py). In the first round one server answers HTTP 500 to its first request, and the
other is SIGKILLed while its streams are mid-way. No healthy engine is retired, the run goes on
on the survivor, and no cut-off sample is trained (the sample dumps are audited: each stream the
kill cut is trained whole, continued from the very tokens it had streamed).

Elsewhere: a server killed mid-round in partial mode and the run stopped naming the engine when
none is left (test_engine_failure.py, its dumps audited the same way); an agent's request longer
than the engine's limit answered 400 with nothing retired and the next call served
(test_request_errors.py, on the shared server and on an in-process engine)."""
import json
import os
import secrets
import signal
import subprocess
import sys

import pytest
from chaos_proxy import ChaosProxy
from conftest import ROOT
from sample_audit import audit_dumps

STEPS, GROUPS, N, MAX_NEW = 2, 8, 4, 56           # half recipes/tiny_cpu.yaml's batch; its budget


@pytest.fixture
def doomed_server(tiny_model, tmp_path_factory):
    """A second vLLM server on the tiny model, its worker on a core of its own (the last). Started,
    not waited for: it comes up while the shared server and the trainer start."""
    from megarl.rollout.servers import LocalServer
    from megarl.rollout.vllm_settings import BIND_ENV, cpu_binds

    binds = cpu_binds(2, 1, sorted(os.sched_getaffinity(0)))
    server = LocalServer(tiny_model, tmp_path_factory.mktemp("doomed") / "engine_1.log",
                         api_key=secrets.token_hex(16), seed=1, max_model_len=256, kv_cache_mb=64,
                         weight_backend="gloo", env={BIND_ENV: binds[-1]} if binds else None)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _kill(server):
    os.killpg(server.proc.pid, signal.SIGKILL)      # the whole server: API process, engine core, worker


def test_a_500_once_and_a_server_killed_mid_round_retire_no_healthy_engine_and_train_no_cut_off_sample(
        tiny_model, doomed_server, remote_engine, tmp_path):
    flaky = ChaosProxy(remote_engine.server.url, fail_first=True).start()
    doomed = ChaosProxy(doomed_server.url, on_first_token=lambda: _kill(doomed_server),
                        api_key=doomed_server.api_key).start()
    run_dir = tmp_path / "run"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "megarl.cli", "train", "recipes/tiny_cpu.yaml", f"model.path={tiny_model}",
             f"data.prompts={tiny_model}/prompts.jsonl", f"run.dir={run_dir}", f"train.steps={STEPS}",
             f"train.groups_per_step={GROUPS}",
             "rollout.mode=sync", "rollout.dump_every=1", "rollout.engines.mode=remote",
             f"rollout.engines.urls=[{flaky.url},{doomed.url}]", "rollout.engines.count=2",
             "rollout.engines.failures_max=1", "checkpoint.resume=false"],
            cwd=ROOT, capture_output=True, text=True, timeout=900,
            env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **remote_engine.env})
    finally:
        flaky.stop()
        doomed.stop()
    err = proc.stderr
    assert proc.returncode == 0, err[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    # the 500: its request sent to the same server again and served; that engine never retired
    failed = flaky.streams[0]
    assert failed["status"] == 500
    again = [s for s in flaky.streams[1:] if s["key"] == failed["key"]]
    assert len(again) == 1 and again[0]["status"] == 200 and again[0]["done"], again
    assert rows[0]["engine_retries"] >= 1 and "engine engine0 failed" not in err, err[-4000:]
    # the kill: in the first round, streams were cut with tokens; only engine1 retired, once
    cut = [s for s in doomed.streams if s["status"] == 200 and not s["done"] and s["tokens"]]
    assert cut and doomed.cut, doomed.streams
    assert all(r["engine_failures"] == 1 and r["engines_alive"] == 1 for r in rows), rows
    assert err.count("failed and was retired") == 1 and "engine engine1 failed and was retired" in err, err[-4000:]
    # the run went on: full batches; no sample trained cut off; each cut stream trained whole from its tokens
    assert all(r["samples"] == GROUPS * N for r in rows), rows
    dumps = audit_dumps(run_dir, STEPS, MAX_NEW)
    assert all(len(samples) == GROUPS * N for samples in dumps.values())
    for s in cut:
        trained = [d for d in dumps[0] if d["prompt_ids"] == s["prompt"]
                   and d["response_ids"][:len(s["tokens"])] == s["tokens"]]
        assert trained, f"the stream {s['key']} cut after {s['tokens']} was not trained from those tokens"
        assert trained[0]["logprobs"][:len(s["tokens"])] == pytest.approx(s["logprobs"], abs=1e-6)
