"""`sbatch slurm/ppo_70b.sh` end to end under the local slurm stand-in (tests/slurm_standin).

Two fake nodes on this machine: the first runs the trainer (srun + torchrun, one gloo rank), the
second one vLLM server (srun + `python -m megarl.rollout.engines.serve`) on CPU; the tiny recipe comes in
through the script's own variables. SIGTERM to the batch shell (what `#SBATCH
--signal=B:TERM@...` does) makes the trainer save and stop, the job requeues itself, and the
second run resumes from the same RUN_DIR.
"""
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import psutil
from conftest import ROOT, VLLM_SERVER, is_vllm_server

STANDIN = ROOT / "tests" / "slurm_standin" / "bin"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


class Tree(threading.Thread):
    """Every process below `pid`, sampled every 0.3 s while it runs (servers' ids, env, argv)."""

    def __init__(self, pid):
        super().__init__(daemon=True)
        self.root, self.seen, self.info, self.done = pid, {}, {}, False

    def run(self):
        while not self.done:
            try:
                for p in psutil.Process(self.root).children(recursive=True):
                    key = (p.pid, p.create_time())
                    if key not in self.seen:
                        self.seen[key] = p
                    if key not in self.info:
                        try:
                            argv = p.cmdline()
                            if VLLM_SERVER in argv or "megarl.cli" in argv:
                                self.info[key] = (argv, p.environ(), p.parent().cmdline())
                        except psutil.Error:
                            pass
            except psutil.Error:
                pass
            time.sleep(0.3)

    def servers(self):
        return [v for v in self.info.values() if is_vllm_server(v[0], v[2])]

    def ranks(self):   # torchrun's workers (not torchrun, the task shell, `megarl plan`, forks)
        return [v for v in self.info.values() if "megarl.cli" in v[0] and "torch.distributed.run" in v[2]]


def _env(tmp_path, run_dir, extra: str, **settings) -> dict:
    """sbatch's environment: the stand-in first on PATH, the tiny recipe on two CPU "nodes"
    through the script's variables, `settings` on top; nothing of an outer job or run."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE",
           "PATH": f"{STANDIN}:{os.environ['PATH']}", "SLURM_STANDIN_STATE": str(tmp_path / "state"),
           "RECIPE": "recipes/tiny_cpu.yaml", "TRAINER_NODES": "1", "ENGINE_NODES": "1",
           "GPUS_PER_NODE": "0", "TRAINER_PROCS_PER_NODE": "1", "ENGINE_TP": "1", "ENGINES_PER_NODE": "1",
           "PORT_BASE": str(_free_port()), "MASTER_PORT": str(_free_port()), "WEIGHT_PORT": str(_free_port()),
           "RUN_DIR": str(run_dir), "DOCTOR": "0",
           "MEGARL_PY": sys.executable, "EXTRA": extra, **settings}
    for var in ("NODE_ADDRS", "SLURM_JOB_ID", "MEGARL_ENGINE_API_KEY", "RANK", "WORLD_SIZE"):
        env.pop(var, None)
    return env


class Submission:
    """`sbatch SCRIPT` under the stand-in with its process tree watched. Leaving the block while
    the job still runs (a failed assertion, a timeout) cancels it: scancel, then sbatch killed."""

    def __init__(self, script: str, env: dict, tmp_path):
        self.script, self.env, self.tmp_path = script, env, tmp_path

    def __enter__(self):
        self.proc = subprocess.Popen(["sbatch", "--nodes=2", f"--output={self.tmp_path}/slurm-%j.out", self.script],
                                     cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.tree = Tree(self.proc.pid)
        self.tree.start()
        first = self.proc.stdout.readline()                      # "Submitted batch job N"
        self.job = first.split()[-1] if first.startswith("Submitted batch job") else None
        if self.job is None:                                      # sbatch refused: say why
            self.__exit__(None, None, None)
            raise AssertionError(f"sbatch {self.script} did not submit: {first}{self.proc.stdout.read()}")
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            if self.job is not None:
                subprocess.run(["scancel", self.job], env=self.env)
            self.proc.kill()
            self.proc.wait()
        self.tree.done = True
        self.tree.join()


def _assert_nothing_left(*trees: Tree, within_s: float = 2.0) -> None:
    """Every process the trees saw has exited (zombies count as gone) within `within_s`
    seconds; polled, so the usual case (all gone already) does not wait."""
    deadline = time.time() + within_s
    while True:
        left = [p for t in trees for p in t.seen.values() if _running(p)]
        if not left or time.time() >= deadline:
            break
        time.sleep(0.1)
    assert not left, [(p.pid, p.cmdline()) for p in left]


def _running(p) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:     # exited between the two calls
        return False


def test_sbatch_ppo_70b_runs_checkpoints_on_sigterm_requeues_and_resumes(tiny_model, tmp_path):
    """Contract: under the stand-in, `sbatch slurm/ppo_70b.sh` with the tiny recipe starts one
    trainer rank and one vLLM server (bound to the node's address, API key only in its
    environment), trains; SIGTERM to the batch shell makes the trainer save a checkpoint and
    exit 0; the job requeues itself and resumes from the newest checkpoint in the same RUN_DIR:
    metrics rows 0..2 each once. Each run writes a log folder (git revision, resolved config,
    job and environment without the key, trainer and engine logs), and no process is left.
    A second `sbatch` of the recipe resumes the same way: its RUN_DIR is the first's
    (tests/unit/test_job_layout.py) and a longer train.steps is a setting a resume may change
    (tests/unit/test_check_resume.py), so it starts no third job here (each costs a server and
    a trainer start: a minute of the suite)."""
    run_dir = tmp_path / "run"
    env = _env(tmp_path, run_dir, f"model.path={tiny_model} data.prompts={tiny_model}/prompts.jsonl "
                                  f"train.steps=3 rollout.mode=sync metrics.tensorboard=false",
               STOP_TIMEOUT="20", ENGINE_START_TIMEOUT="900")
    port = int(env["PORT_BASE"])
    t0 = time.time()
    metrics = run_dir / "metrics.jsonl"
    with Submission("slurm/ppo_70b.sh", env, tmp_path) as sub:
        proc, job, tree = sub.proc, sub.job, sub.tree
        deadline = time.time() + 900
        while not _rows(metrics):
            assert proc.poll() is None, (proc.stdout.read(), _logs(tmp_path, run_dir))
            assert time.time() < deadline, _logs(tmp_path, run_dir)
            time.sleep(0.3)
        # the time limit is near: slurm signals the batch shell (#SBATCH --signal=B:TERM@...)
        subprocess.run(["scancel", "--signal=TERM", "--batch", job], env=env, check=True)
        out, _ = proc.communicate(timeout=1200)
    wall = time.time() - t0
    logs = _logs(tmp_path, run_dir)
    assert proc.returncode == 0, (out, logs)

    # two runs of job N: the first stopped on SIGTERM after a checkpoint, the second resumed
    first, second = run_dir / f"slurm-{job}", run_dir / f"slurm-{job}-restart1"
    first_log, second_log = (first / "trainer.log").read_text(), (second / "trainer.log").read_text()
    assert "stopping after step" in first_log and "SIGTERM" in first_log, first_log[-3000:]
    stopped = int(re.search(r"stopping after step (\d+)", first_log).group(1))
    assert stopped < 2, first_log[-3000:]
    assert re.search(rf"resumed from \S*step_{stopped} at step {stopped + 1}", second_log), second_log[-3000:]
    assert f"requeueing job {job}" in logs
    assert [r["step"] for r in _rows(metrics)] == [0, 1, 2]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir())[-1] == "step_2"

    # per-run log folders
    for folder in (first, second):
        names = {p.name for p in folder.iterdir()}
        assert {"git.txt", "config.yaml", "job.txt", "env.txt", "overrides.txt", "trainer.log", "engines"} <= names
        raw = (folder / "trainer.log").read_bytes()   # bytes: read_text would turn a "\r" into "\n"
        assert b"\r" not in raw and b"\x1b" not in raw, raw[-3000:]   # plain lines: no bar redraws, no colours
        config = (folder / "config.yaml").read_text()
        assert "    mode: remote" in config and f"http://127.0.0.1:{port}" in config
        assert re.match(r"[0-9a-f]{40}|not a git checkout", (folder / "git.txt").read_text())
        assert "SLURM_JOB_ID=" in (folder / "env.txt").read_text()
        engine_log = (folder / "engines" / "engine_0.log").read_text()
        assert "--logprobs-mode processed_logprobs" in engine_log and f"--host 127.0.0.1 --port {port}" in engine_log
    assert "restart 1" in (second / "job.txt").read_text()

    # one server per run, bound to the node's address; its key in the environment only, and
    # nowhere in the logs; one trainer rank per run, talking to it in remote mode
    servers, ranks = tree.servers(), tree.ranks()
    assert len(servers) == 2 and len(ranks) == 2, (len(servers), len(ranks))
    for argv, senv, _ in servers:
        assert argv[argv.index("--host") + 1] == "127.0.0.1" and "--api-key" not in argv
        # its socket files in the owner-only folder `megarl.rollout.engines.serve` named after itself
        assert os.path.basename(senv["VLLM_RPC_BASE_PATH"]).startswith("megarl-rpc-"), senv.get("VLLM_RPC_BASE_PATH")
        key = senv["VLLM_API_KEY"]
        assert len(key) >= 32
        for path in [*tmp_path.glob("slurm-*.out"), *run_dir.rglob("*.txt"), *run_dir.rglob("*.log"),
                     *run_dir.rglob("*.yaml")]:
            assert key not in path.read_text(errors="replace"), path
    assert all(renv.get("MEGARL_ENGINE_API_KEY") == senv["VLLM_API_KEY"]
               for (_, renv, _), (_, senv, _) in zip(ranks, servers))

    _assert_nothing_left(tree)
    print(f"slurm stand-in: 2 runs of job {job} in {wall:.0f} s")


def test_engines_not_up_by_the_deadline_stop_the_job_with_the_server_log(tiny_model, tmp_path):
    """Contract: the job's layout is the recipe's `cluster:` section (2 nodes: 1 trainer, 1
    engine node); ENGINES_PER_NODE in the environment replaces its derived value and the log
    says so, and says the one server it starts replaces the recipe's rollout.engines.count=2;
    `megarl doctor` runs first on a trainer and an engine node. A server that does not answer
    /health within ENGINE_START_TIMEOUT (here: suspended the moment `serve` has written its
    first lines and become the vLLM server, so it never answers whatever the machine's speed: a
    tiny server on a quiet machine answered within the 25 s) stops the job: exit 1, the batch
    output names the server and shows the last lines of its log, the trainer step that was
    starting is stopped too, and no process is left."""
    run_dir = tmp_path / "run"
    recipe = tmp_path / "cluster.yaml"
    recipe.write_text(f"defaults: [{ROOT / 'recipes' / 'tiny_cpu.yaml'}]\ncluster:\n  nodes: 2\n"
                      "  trainer_nodes: 1\n  engine_nodes: 1\nrollout:\n  engines:\n    count: 2\n")
    env = _env(tmp_path, run_dir, f"model.path={tiny_model} data.prompts={tiny_model}/prompts.jsonl train.steps=1",
               # long enough for `megarl.rollout.engines.serve` to print its first line under load (12 s was not)
               STOP_TIMEOUT="10", ENGINE_START_TIMEOUT="25", RECIPE=str(recipe), ENGINES_PER_NODE="1", DOCTOR="1")
    for var in ("TRAINER_NODES", "ENGINE_NODES", "GPUS_PER_NODE", "TRAINER_PROCS_PER_NODE", "ENGINE_TP"):
        del env[var]     # the recipe's
    with Submission("slurm/ppo_7b.sh", env, tmp_path) as sub:
        _suspend_the_server(sub)
        out, _ = sub.proc.communicate(timeout=300)
    proc = sub.proc
    logs = _logs(tmp_path, run_dir)
    assert proc.returncode == 1, (out, logs)
    batch = next(tmp_path.glob("slurm-*.out")).read_text()
    assert "not healthy after 25 s" in batch and "Last lines of its log" in batch, batch
    assert "# megarl: engine 0 at http://127.0.0.1:" in batch        # the server log's first line
    assert "the engines did not come up" in batch
    assert "1 trainer node(s) x 1 ranks, 1 engine node(s) x 1 server(s) of ENGINE_TP=1" in batch, batch
    assert "ENGINES_PER_NODE=1 from the environment replaces the default 2" in batch, batch
    assert "rollout.engines.count=2 is replaced by the 1 servers the slurm job starts" in batch, batch
    assert batch.count("megarl doctor: OK") == 2, batch    # a trainer and an engine node
    job_log = next(run_dir.glob("slurm-*"))
    assert "rollout.engines.count=1" in (job_log / "overrides.txt").read_text().split()
    assert "layout: rollout.engines.count=2 is replaced" in (job_log / "job.txt").read_text()
    # no step was trained: no step's checkpoint, and no metrics row (the file is made at the first step)
    assert not list(run_dir.glob("checkpoints/step_*")), list(run_dir.glob("checkpoints/*"))
    assert not (run_dir / "metrics.jsonl").exists()
    _assert_nothing_left(sub.tree)


def _suspend_the_server(sub: Submission, within_s: float = 240) -> None:
    """SIGSTOP the job's vLLM server as soon as it appears below the job (serve prints its first
    lines, then execs it; importing vLLM alone takes seconds, so it is stopped long before it
    could answer /health)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end and sub.proc.poll() is None:
        try:
            for p in psutil.Process(sub.proc.pid).children(recursive=True):
                try:
                    if VLLM_SERVER in p.cmdline():
                        p.suspend()
                        return
                except psutil.Error:
                    pass
        except psutil.Error:
            break
        time.sleep(0.05)
    raise AssertionError(f"no vLLM server started below the job within {within_s} s")


def _logs(tmp_path, run_dir) -> str:
    """The batch output and the newest trainer/engine log tails, for assertion messages."""
    parts = []
    for path in [*tmp_path.glob("slurm-*.out"), *run_dir.glob("slurm-*/trainer.log"),
                 *run_dir.glob("slurm-*/engines/*.log")]:
        parts.append(f"--- {path}\n{path.read_text(errors='replace')[-2500:]}")
    return "\n".join(parts)
