"""Chaos on real engines: a sync-mode `megarl train` on two vLLM servers (remote mode: the
session's shared server of tests/conftest.py and one this file starts), each behind a proxy
(chaos_proxy.py). In the first round one server answers HTTP 500 to its first request, and the
other is SIGKILLed while its streams are mid-way. No healthy engine is retired, the next step
trains a full batch on the survivor, and no cut-off sample is trained (the sample dumps are
audited: each stream the kill cut is trained whole, continued from the very tokens it had
streamed). In the third round the survivor dies too (its proxy stops relaying at a first
token): the run stops with one line naming it.

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

STEPS, GROUPS, N, MAX_NEW = 3, 8, 4, 56           # half recipes/tiny_cpu.yaml's batch; its budget
TRAINED = 2                                         # steps before the survivor dies in the third round


@pytest.fixture
def doomed_server(tiny_model, tmp_path_factory):
    """A second vLLM server on the tiny model, its worker on a core of its own (the last). Started,
    not waited for: it comes up while the shared server and the trainer start."""
    from megarl.rollout.engines.servers import LocalServer
    from megarl.rollout.engines.vllm_settings import BIND_ENV, cpu_binds

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


def _retirements(err: str) -> list[str]:
    return [line for line in err.splitlines() if "failed and was retired" in line]


def test_a_500_once_and_a_server_killed_mid_round_retire_no_healthy_engine_and_train_no_cut_off_sample(
        tiny_model, doomed_server, remote_engine, tmp_path):
    # engine0: answers its first request 500; dies at the first token after the third push
    # (push 1 before step 0, 2 and 3 after steps 0 and 1: it dies in the third round)
    flaky = ChaosProxy(remote_engine.server.url, fail_first=True, die=True,
                       armed_by=("/update_weight_version", TRAINED + 1)).start()
    # engine1: SIGKILLed at its first token
    doomed = ChaosProxy(doomed_server.url, api_key=doomed_server.api_key, die=True,
                        on_death=lambda: _kill(doomed_server)).start()
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
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(TRAINED)), err[-6000:]
    # the 500: its request sent to the same server again and served; that engine kept
    failed = flaky.streams[0]
    assert failed["status"] == 500
    again = [s for s in flaky.streams[1:] if s["key"] == failed["key"]]
    assert len(again) == 1 and again[0]["status"] == 200 and again[0]["done"], again
    assert rows[0]["engine_retries"] >= 1
    # the kill: streams cut with tokens in the first round; only engine1 retired until the end
    cut = [s for s in doomed.streams if s["status"] == 200 and not s["done"] and s["tokens"]]
    assert cut and doomed.dead, doomed.streams
    assert all(r["engine_failures"] == 1 and r["engines_alive"] == 1 for r in rows), rows
    retired = _retirements(err)
    assert len(retired) == 2 and "engine engine1 failed" in retired[0], retired
    assert "engine engine0 failed" in retired[1] and "HTTP 500" not in retired[1] and flaky.dead, retired
    # the run went on: full batches; no sample trained cut off; each cut stream trained whole from its tokens
    assert all(r["samples"] % (GROUPS * N) == 0 < r["samples"] <= 8 * GROUPS * N for r in rows), rows   # elastic steps
    dumps = audit_dumps(run_dir, TRAINED, MAX_NEW)
    assert all(len(samples) % (GROUPS * N) == 0 < len(samples) <= 8 * GROUPS * N for samples in dumps.values())
    for s in cut:
        trained = [d for d in dumps[0] if d["prompt_ids"] == s["prompt"]
                   and d["response_ids"][:len(s["tokens"])] == s["tokens"]]
        assert trained, f"the stream {s['key']} cut after {s['tokens']} was not trained from those tokens"
        assert trained[0]["logprobs"][:len(s["tokens"])] == pytest.approx(s["logprobs"], abs=1e-6)
    # then the survivor died: the run stops, its last line naming it
    assert proc.returncode == 1, err[-6000:]
    last = [line for line in err.strip().splitlines() if line.startswith("megarl:")][-1]
    assert "engine error" in last and "engine engine0" in last and flaky.url in last, last
