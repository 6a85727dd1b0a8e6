"""A rollout engine that dies in the middle of a run: a clear error, no hang, nothing left over."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil

from conftest import ROOT


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_killing_a_local_server_mid_run_stops_with_a_named_error(tiny_model, tmp_path):
    """Contract: `megarl train` with 2 local vLLM servers; one server is SIGKILLed while steps
    run. The run exits non-zero well within the engine timeout with one line naming the
    engine and its log file; every process megarl started is gone and the staging folder is
    empty."""
    staging = tmp_path / "staging"
    staging.mkdir()
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "megarl.cli", "train", "recipes/tiny_cpu.yaml",
           f"model.path={tiny_model}", f"data.prompts={tiny_model}/prompts.jsonl", f"run.dir={run_dir}",
           "train.steps=500", "rollout.engine_mode=local_servers", "rollout.engines=2",
           "rollout.engine_timeout_s=30", f"weight_sync.staging_dir={staging}", "checkpoint.resume=false"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    try:
        deadline = time.time() + 600
        while len(_rows(run_dir / "metrics.jsonl")) < 2:
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            assert time.time() < deadline, "the run did not reach step 2 in 10 minutes"
            time.sleep(0.5)
        tree = psutil.Process(proc.pid).children(recursive=True)
        servers = [p for p in tree if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline())]
        assert len(servers) == 2, [p.cmdline() for p in tree]
        victim = servers[1]
        argv = victim.cmdline()
        port = argv[argv.index("--port") + 1]
        t_kill = time.time()
        victim.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=180)
        elapsed = time.time() - t_kill
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode not in (0, None)
    assert elapsed < 120, elapsed
    last = [line for line in err.strip().splitlines() if line.startswith("megarl:")]
    assert last and "engine error" in last[-1], err[-3000:]
    assert f"127.0.0.1:{port}" in last[-1] and ".log" in last[-1], last[-1]
    time.sleep(2)
    leftovers = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not leftovers, [(p.pid, p.cmdline()) for p in leftovers]
    assert os.listdir(staging) == []
