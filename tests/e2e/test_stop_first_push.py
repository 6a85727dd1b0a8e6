"""A SIGTERM during the first weight push stops `megarl train` at once (megarl/train.py
`_push_first`; the evaluation's and the multi-rank cases: tests/unit/test_stop_phases.py).

The engine is a stand-in HTTP server that starts as a vLLM server does (healthy, a served model,
the dev-mode endpoints) and then never answers the push's calls (GET /get_world_size, POST
/collective_rpc): the push waits on it, as on an engine that hangs or a slow first transfer.
No vLLM starts: the cost is the trainer's own start."""
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time

from conftest import ROOT

HANGS = ("/get_world_size", "/collective_rpc", "/init_weight_transfer_engine", "/start_weight_update")


def stand_in_server():
    """(server, hits, release): answers like a started vLLM server; the push's calls hang until
    `release` is set."""
    hits, release = [], threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self, body) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _serve(self) -> None:
            path = self.path.split("?")[0]
            hits.append(path)
            if path in HANGS:
                release.wait()
                return
            if path == "/v1/models":
                self._answer({"data": [{"id": "tiny", "max_model_len": 4096}]})
            elif path == "/is_paused":
                self._answer({"is_paused": False})
            else:
                self._answer({})

        def do_GET(self):
            self._serve()

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._serve()

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, hits, release


def test_sigterm_during_the_first_push_stops_at_once_without_a_step(tiny_model, tmp_path):
    """The trainer (one rank) waits in its first push (rollout.engines.timeout_s=1200): a SIGTERM
    then ends the run within seconds: exit 0, the line the cluster scripts requeue on, no step,
    no checkpoint, no metrics row. It used to be kept until the push had ended and a whole step
    was done."""
    server, hits, release = stand_in_server()
    run_dir = tmp_path / "pushing"
    cli = [sys.executable, "-m", "megarl.cli", "train", "recipes/tiny_cpu.yaml", f"model.path={tiny_model}",
           f"data.prompts={tiny_model}/prompts.jsonl", f"run.dir={run_dir}", "rollout.engines.mode=remote",
           f"rollout.engines.urls=[http://127.0.0.1:{server.server_address[1]}]",
           "rollout.engines.timeout_s=1200", "metrics.tensorboard=false"]
    proc = subprocess.Popen(cli, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    try:
        deadline = time.time() + 600
        while not any(h in HANGS for h in hits) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert any(h in HANGS for h in hits), f"the trainer never began its push: {proc.poll()} {hits}"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)   # without the stop: the push's 1200 s, then a step
    finally:
        if proc.poll() is None:
            proc.kill()
        release.set()
        server.shutdown()
    assert proc.returncode == 0, err[-4000:]
    assert "stopping before step 0 (SIGTERM): nothing new to save" in out, out[-2000:] + err[-2000:]
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip()
