"""Rollout engines that die in the middle of a run: the survivors carry on; when none is left, a clear
error, no hang, nothing left over."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil
from conftest import ROOT, is_vllm_server
from sample_audit import audit_dumps


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _is_server(p) -> bool:
    try:
        return is_vllm_server(p.cmdline(), p.parent().cmdline())
    except psutil.Error:
        return False


def _servers(proc):
    tree = psutil.Process(proc.pid).children(recursive=True)
    return tree, [p for p in tree if _is_server(p)]


def _cores(server) -> tuple[str, set]:
    """The VLLM_CPU_OMP_THREADS_BIND megarl gave a server, and the cores its vLLM worker is
    pinned to (the narrowest affinity among its processes: the worker binds its threads)."""
    affinities = []
    for p in server.children(recursive=True):
        try:
            affinities.append(set(p.cpu_affinity()))
        except psutil.Error:         # a short-lived helper process gone meanwhile
            pass
    narrowest = min(affinities, key=len) if affinities else set()
    return server.environ().get("VLLM_CPU_OMP_THREADS_BIND", ""), narrowest


def _wait_rows(proc, path, count, timeout=600):
    deadline = time.time() + timeout
    while len(_rows(path)) < count:
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        assert time.time() < deadline, f"the run did not log {count} steps in {timeout} s"
        time.sleep(0.2)


def _left_running(procs, within_s=2.0):
    """The processes of `procs` still running (zombies count as gone) once they have had
    `within_s` seconds to exit; polled, so the usual case (all gone) returns at once."""
    deadline = time.time() + within_s
    while True:
        left = [p for p in procs if _running(p)]
        if not left or time.time() >= deadline:
            return left
        time.sleep(0.1)


def _running(p) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:     # exited between the two calls
        return False


def test_a_dead_server_is_replaced_and_too_many_failures_stop_the_run(tiny_model, tmp_path):
    """Contract: `megarl train` with 2 local vLLM servers (partial rollout,
    rollout.engines.failures_max=1). One server is SIGKILLed while steps run: the run goes on
    on the other one (its in-flight requests continue there), every later step trains a full
    batch, each step's metrics count the failure, and a fresh server started in its place
    joins at a weight push (engines_alive back to 2, engine_restarts 1). Then every server is
    killed: the second failure is one too many, and the run exits non-zero well within the
    engine timeout with one line naming an engine and its log file; every process megarl
    started is gone. Every step's samples are dumped
    (rollout.dump_every=1) and audited: none trained cut off by the kill (sample_audit.py)."""
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    cmd = [sys.executable, "-m", "megarl.cli", "train", "recipes/tiny_cpu.yaml",
           f"model.path={tiny_model}", f"data.prompts={tiny_model}/prompts.jsonl", f"run.dir={run_dir}",
           "train.steps=500", "rollout.engines.mode=local_servers", "rollout.engines.count=2",
           "rollout.engines.timeout_s=30", "rollout.engines.failures_max=1",
           "rollout.dump_every=1", "checkpoint.resume=false", "rollout.partial.max_step_multiple=2"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    try:
        _wait_rows(proc, metrics, 1)                 # steps run: step 0 logged, step 1 under way
        tree, servers = _servers(proc)
        assert len(servers) == 2, [p.cmdline() for p in tree]
        # each server's worker on cores of its own (vLLM's `auto` pinned both to the first
        # core; build.engine_env), and its replacement below on the same ones
        binds = [_cores(s) for s in servers]
        assert all(b[0] and b[1] for b in binds) and not binds[0][1] & binds[1][1], binds
        servers[1].send_signal(signal.SIGKILL)
        killed_at = len(_rows(metrics))
        _wait_rows(proc, metrics, killed_at + 3)     # the run goes on with one engine
        deadline = time.time() + 300                 # ... and the replacement joins at a push
        while not any(r["engines_alive"] == 2 for r in _rows(metrics)[killed_at + 1:]):
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            assert time.time() < deadline, "the replacement never joined"
            time.sleep(0.2)
        tree2, now = _servers(proc)
        assert len(now) == 2 and servers[0].pid in {p.pid for p in now}, [p.cmdline() for p in now]
        assert sorted(_cores(s)[0] for s in now) == sorted(b[0] for b in binds), (binds, [_cores(s) for s in now])
        ports = {p.cmdline()[p.cmdline().index("--port") + 1] for p in now}
        tree = tree + [p for p in tree2 if p.pid not in {q.pid for q in tree}]
        t_kill = time.time()
        for p in now:
            p.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=180)
        elapsed = time.time() - t_kill
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rows = _rows(metrics)
    assert [r["step"] for r in rows] == list(range(len(rows)))     # no step lost or repeated
    after = rows[killed_at + 1:]
    assert after and all(r["engine_failures"] == 1 for r in after)
    assert after[0]["engines_alive"] == 1 and after[-1]["engines_alive"] == 2, after
    assert all(r["engine_restarts"] == (r["engines_alive"] == 2) for r in after), after
    # a full batch every step (tiny recipe: 16 groups x 4 samples), all of it generated
    # (elastic steps, rollout.partial.max_step_multiple: a step may train a whole multiple of 16 groups)
    batch = 16 * 4
    assert all(r["samples"] % batch == 0 < r["samples"] <= 2 * batch and r["response_len_mean"] > 0
               for r in after), after
    dumps = audit_dumps(run_dir, len(rows), 56)
    assert all(len(samples) % batch == 0 < len(samples) <= 2 * batch for samples in dumps.values())
    assert err.count("failed and was retired") >= 2 and "restarted; it joins" in err, err[-3000:]
    assert proc.returncode not in (0, None)
    assert elapsed < 120, elapsed
    last = [line for line in err.strip().splitlines() if line.startswith("megarl:")]
    assert last and "engine error" in last[-1], err[-3000:]
    assert "rollout.engines.failures_max=1" in last[-1] or "no rollout engine left" in last[-1], last[-1]
    assert any(f"127.0.0.1:{port}" in last[-1] for port in ports) and ".log" in last[-1], last[-1]
    leftovers = _left_running(tree)
    assert not leftovers, [(p.pid, p.cmdline()) for p in leftovers]
