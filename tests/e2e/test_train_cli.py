"""`megarl train` end to end on CPU: real megatron-core trainer, real vLLM engine, tiny model."""
import json
import os

import pytest
from conftest import ROOT, run_py

REQUIRED = ("step", "reward_mean", "response_len_mean", "response_len_max", "policy_loss",
            "value_loss", "clip_frac", "entropy", "step_time_s", "rollout_time_s", "train_time_s",
            "sync_time_s", "logprob_mismatch_mean", "weight_version",
            # speed and resources (docs/metrics.md); mfu and gpu_mem_peak_gb on GPUs only
            "lr_actor", "lr_critic", "rollout_tokens_per_s", "train_tokens_per_s", "host_mem_peak_gb")


def train(tiny_model, run_dir, *overrides, nproc=1, env=None):
    cli = ["-m", "megarl.cli", "train", "recipes/tiny_cpu.yaml", f"model.path={tiny_model}",
           f"data.prompts={tiny_model}/prompts.jsonl", f"run.dir={run_dir}", *overrides]
    launcher = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"]
    proc = run_py(launcher + cli if nproc > 1 else cli, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return proc, rows


@pytest.fixture(scope="module")
def ppo_run(tiny_model, tmp_path_factory):
    """An uninterrupted three-step PPO run (shared by the tests below)."""
    run_dir = tmp_path_factory.mktemp("ppo") / "run"
    # sync: its samples depend only on the seed, so the resume test below can compare exactly
    proc, rows = train(tiny_model, run_dir, "train.steps=3", "weight_sync.verify=true", "rollout.mode=sync")
    return run_dir, proc, rows


def test_ppo_run_writes_metrics_tensorboard_and_config(ppo_run):
    """Three PPO steps: one metrics.jsonl row per step with every promised key, TensorBoard
    event files, the resolved config, a progress line per step, versions advancing, and engine
    logprobs matching the trainer's (the push after each step reached the engine)."""
    run_dir, proc, rows = ppo_run
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert set(REQUIRED) <= set(r), set(REQUIRED) - set(r)
        assert 0.0 <= r["reward_mean"] <= 1.0
        assert r["logprob_mismatch_mean"] < 1e-3
        assert r["sync_verify_gap"] < 1e-3
    assert [r["weight_version"] for r in rows] == [1, 2, 3]
    for r in rows:   # the recipe's constant rates; tokens per second of real work; a process of some size
        assert (r["lr_actor"], r["lr_critic"]) == (1e-4, 1e-3)
        assert r["rollout_tokens_per_s"] > 0 and r["train_tokens_per_s"] > 0 and r["host_mem_peak_gb"] > 0.1
        assert "mfu" not in r and "gpu_mem_peak_gb" not in r     # CPU: no GPU, no peak to compare with
        assert "kl" not in r and "kl_penalty" not in r           # algo.kl_coef=0: no reference model
    assert rows[-1]["value_loss"] > 0 and rows[-1]["grad_norm"] > 0
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert "steps: 3" in (run_dir / "config.yaml").read_text()
    assert proc.stderr.count("step    ") + proc.stdout.count("step    ") >= 3


def test_sigterm_saves_and_resume_reproduces_the_run(tiny_model, remote_engine, tmp_path, ppo_run):
    """SIGTERM mid-run (slurm pre-emption) makes every rank save and exit cleanly; `megarl train`
    on the same run dir resumes after the checkpoint, and the resumed run's rewards and losses
    equal the uninterrupted run's step for step. Both legs use a vLLM server as a remote engine
    and the uninterrupted run an in-process one: sampling depends on the seed alone, not on
    the kind of engine."""
    import signal
    import subprocess
    import sys
    import time
    run_dir = tmp_path / "preempted"
    cli = [sys.executable, "-m", "megarl.cli", "train", "recipes/tiny_cpu.yaml", f"model.path={tiny_model}",
           f"data.prompts={tiny_model}/prompts.jsonl", f"run.dir={run_dir}", "train.steps=2", "rollout.mode=sync",
           *remote_engine.overrides]
    proc = subprocess.Popen(cli, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **remote_engine.env})
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().strip()):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saved and all(name.startswith("step_") for name in saved), saved
    assert "stopping after step" in out + err

    _, rows = train(tiny_model, run_dir, "train.steps=2", "rollout.mode=sync", *remote_engine.overrides,
                    env=remote_engine.env)
    expected = ppo_run[2]
    assert [r["step"] for r in rows] == [0, 1]
    for got, want in zip(rows, expected):
        assert got["reward_mean"] == want["reward_mean"]
        assert got["policy_loss"] == pytest.approx(want["policy_loss"], abs=1e-5)
        assert got["value_loss"] == pytest.approx(want["value_loss"], rel=1e-4)


def test_a_key_given_on_the_command_line_authenticates_and_is_written_nowhere(tiny_model, remote_engine, tmp_path):
    """rollout.engines.api_key on the command line, $MEGARL_ENGINE_API_KEY empty: the run reaches
    its server with that key, and no file the run writes (config.yaml, the checkpoint's, metrics,
    samples, TensorBoard, the offline W&B run with its copy of the command line) nor its output
    holds the key's bytes; the saved configs and W&B's say <redacted> (megarl/config/secrets.py)."""
    from wandb_records import config, run_files
    key = remote_engine.server.api_key
    run_dir = tmp_path / "keyed"
    proc, rows = train(tiny_model, run_dir, "train.steps=1", "rollout.mode=sync", "checkpoint.every=1",
                       "rollout.dump_every=1", "metrics.wandb.project=megarl-test", "metrics.wandb.mode=offline",
                       *remote_engine.overrides, f"rollout.engines.api_key={key}",
                       env={"MEGARL_ENGINE_API_KEY": ""})
    assert [r["step"] for r in rows] == [0]
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert (run_dir / "checkpoints" / "step_0" / "config.yaml") in written and (run_dir / "config.yaml") in written
    assert run_files(run_dir), "no W&B run was written"
    assert [str(p) for p in written if key.encode() in p.read_bytes()] == []
    assert key not in proc.stdout + proc.stderr
    for saved in (run_dir / "config.yaml", run_dir / "checkpoints" / "step_0" / "config.yaml"):
        assert "api_key: <redacted>" in saved.read_text()
    assert config(run_files(run_dir)[0])["rollout"]["engines"]["api_key"] == "<redacted>"


def test_sigterm_while_the_engines_start_stops_at_once_without_a_step(tiny_model, tmp_path):
    """A SIGTERM while the trainer waits for its engines (here a server that answers 503 to
    everything; rollout.engines.start_timeout_s=1200) ends the run within seconds: exit 0, the
    line the cluster scripts requeue on, no step, no checkpoint. It used to be kept until the
    start had ended and a first step was done: far past any scheduler's grace period."""
    import http.server
    import signal
    import subprocess
    import sys
    import threading
    import time
    hits = []

    class NeverHealthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_error(503, "loading")

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NeverHealthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    run_dir = tmp_path / "starting"
    cli = [sys.executable, "-m", "megarl.cli", "train", "recipes/tiny_cpu.yaml", f"model.path={tiny_model}",
           f"data.prompts={tiny_model}/prompts.jsonl", f"run.dir={run_dir}", "rollout.engines.mode=remote",
           f"rollout.engines.urls=[http://127.0.0.1:{server.server_address[1]}]",
           "rollout.engines.start_timeout_s=1200"]
    proc = subprocess.Popen(cli, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    try:
        deadline = time.time() + 600
        while not hits and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert hits, f"the trainer never asked the server for its health: {proc.poll()}"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)   # without the stop: the whole 1200 s start
    finally:
        if proc.poll() is None:
            proc.kill()
        server.shutdown()
    assert proc.returncode == 0, err[-4000:]
    assert "stopping before step 0 (SIGTERM while starting)" in out, out[-2000:] + err[-2000:]
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip()


def test_an_engine_of_tp2_on_cpu_takes_every_push(tiny_model, tmp_path):
    """An engine of rollout.engines.tp=2 on a CPU machine with one NUMA node (vLLM's `auto`
    binding wants a node per worker; megarl binds each worker to a core of its own): both
    workers receive each push through the gloo chain (rank 0 -> worker 0 -> worker 1), and the
    engine samples with the trainer's logprobs after every push."""
    _, rows = train(tiny_model, tmp_path / "etp2", "train.steps=2", "rollout.engines.tp=2", "weight_sync.verify=true",
                    "rollout.mode=sync", "train.groups_per_step=8")
    assert len(rows) == 2 and all(r["sync_bytes"] > 0 for r in rows), rows
    assert all(r["sync_verify_gap"] < 1e-4 and r["logprob_mismatch_mean"] < 1e-4 for r in rows), rows


def test_tensor_parallel_run_with_two_engines_at_temperature(tiny_model, tmp_path):
    """`megarl train ... parallel.tp=2` on 2 torchrun ranks with 2 engines sampling at
    temperature 0.7, top_p 0.9 and top_k 50 (a recipe's nucleus): its pushes (TP shards
    gathered, QKV and gate/up regrouped) reach both engines, and the trainer's logprobs of the
    sampled tokens (logits / 0.7, renormalised over the engines' top-k / top-p set, found on
    the TP group's whole vocabulary) equal the engines' processed logprobs at the fp32 level.
    The dumped samples carry, per token, the version it was generated under (within the
    staleness bound) and the engine's logprob. GRPO: no critic is built or trained.
    checkpoint.hf_every=1 and hf_final: the actor exported after each step, gathered over TP
    (the export's logprobs: tests/dist/test_hf_export.py)."""
    run_dir = tmp_path / "tp2"
    _, rows = train(tiny_model, run_dir, "train.steps=2", "parallel.tp=2", "rollout.engines.count=2",
                    "rollout.sampling.temperature=0.7", "rollout.sampling.top_p=0.9", "rollout.sampling.top_k=50",
                    "rollout.dump_every=1", "weight_sync.verify=true",
                    "algo.name=grpo", "checkpoint.hf_every=1", "checkpoint.hf_final=true", nproc=2)
    exports = {p.name: p for p in (run_dir / "hf").iterdir()}
    assert sorted(exports) == ["final", "step_0", "step_1"]
    for folder in exports.values():
        assert {"config.json", "generation_config.json", "tokenizer.json", "model.safetensors.index.json"} <= {
            p.name for p in folder.iterdir()}
    final = (exports["final"] / "model-00001-of-00001.safetensors").read_bytes()
    assert final == (exports["step_1"] / "model-00001-of-00001.safetensors").read_bytes()
    assert final != (exports["step_0"] / "model-00001-of-00001.safetensors").read_bytes()
    assert len(rows) == 2
    assert all(r["sync_verify_gap"] < 1e-4 and r["logprob_mismatch_mean"] < 1e-4 for r in rows), rows
    # the pushes were staged (the engines paused only for the swap) and sharded (both TP ranks
    # sent their own halves: no rank gathered the model), and still landed exactly (the gaps above)
    assert all(r["sync_staged"] == 1.0 and r["sync_sharded"] == 1.0 for r in rows), rows
    assert all(0 < r["sync_paused_s"] < r["sync_time_s"] and r["sync_link_bytes"] < r["sync_bytes"] for r in rows), rows
    assert all(0 <= r["cut_outside"] < 1e-2 for r in rows), rows   # sampled tokens outside the trainer's cut
    # GRPO trains without a critic: no value loss, group-normalised advantages, only the actor learns
    assert all(r["value_loss"] == 0.0 and "value_mean" not in r for r in rows)
    assert all(abs(r["advantage_mean"]) < 0.5 for r in rows)
    assert all(r["critic_grad_norm"] == 0.0 and r["grad_norm"] > 0 for r in rows)
    for step in (0, 1):
        dumped = [json.loads(x) for x in (run_dir / "samples" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(dumped) % (16 * 4) == 0 < len(dumped) <= 8 * 16 * 4   # elastic steps: whole multiples
        for d in dumped:
            assert len(d["response_ids"]) == len(d["logprobs"]) == len(d["versions"]) > 0
            # partial rollout (the recipe's mode): tokens of at most max_staleness=2 versions back
            assert d["versions"] == sorted(d["versions"]) and step - 2 <= d["versions"][0] <= step
            assert d["versions"][-1] <= step
            assert d["finish_reason"] in ("stop", "length") and 0.0 <= d["reward"] <= 1.0
            assert d["prompt"].startswith("<bos>") and isinstance(d["response"], str)


def test_lag_trains_rounds_k_versions_late_and_resumes_its_queue(tiny_model, remote_engine, tmp_path):
    """rollout.lag=2 on 2 ranks (DP=2: the l_old of each queued round is a collective at
    generation time), GRPO with M2PO and the gradient cosine logged: step k trains tokens
    min(k, 2) versions old; a resume (at 1 rank) continues the checkpointed queue, so every
    prompt drawn is trained once or is still queued, none twice, and staleness stays 2."""
    import torch
    run_dir = tmp_path / "lagged"
    common = ["rollout.mode=sync", "rollout.lag=2", "algo.name=grpo", "algo.m2po_tau=0.04",
              "algo.grad_align=log", "checkpoint.every=2", "rollout.dump_every=1", *remote_engine.overrides]
    _, rows = train(tiny_model, run_dir, "train.steps=4", *common, nproc=2, env=remote_engine.env)
    assert [r["staleness_mean"] for r in rows] == [0, 1, 2, 2]
    assert all(r["lag_rounds_queued"] == 2 and 0 <= r["m2po_masked_frac"] <= 1 for r in rows)
    assert all(-1 <= r["grad_cosine"] <= 1 for r in rows)    # every step has 2 updates: one with a predecessor
    queue = torch.load(run_dir / "checkpoints" / "step_3" / "driver.pt", weights_only=True)["lag"]["rounds"]
    assert len(queue) == 2
    assert all(len(s["old_logprobs"]) == len(s["response_ids"]) for r in queue for s in r["samples"])

    _, rows = train(tiny_model, run_dir, "train.steps=6", *common, env=remote_engine.env)
    assert [r["step"] for r in rows] == list(range(6)) and [r["staleness_mean"] for r in rows[4:]] == [2, 2]
    trained = {}
    for step in range(6):
        for line in (run_dir / "samples" / f"step_{step}.jsonl").read_text().splitlines():
            s = json.loads(line)
            assert set(s["versions"]) == {max(0, step - 2)}, (step, s["versions"])
            trained.setdefault(s["uid"], set()).add(step)
    assert all(len(steps) == 1 for steps in trained.values()), "a prompt was trained at two steps"
    queued = {s["uid"] for r in torch.load(run_dir / "checkpoints" / "step_5" / "driver.pt",
                                             weights_only=True)["lag"]["rounds"] for s in r["samples"]}
    assert not queued & set(trained) and set(trained) | queued == set(range(len(trained) + len(queued)))


def test_lora_run_trains_adapters_on_a_frozen_base_through_the_engine(tiny_model, remote_engine, tmp_path):
    """PPO with LoRA (model.lora.rank=8) through a vLLM engine, 3 steps: the engine samples
    from the merged weights (logprob mismatch and the verify probe < 1e-4 every step); the
    checkpoints hold the actor's adapters only and name the base; the adapters moved (B from 0,
    and between steps). The base did not: a second run resumed from step 1's adapters-only
    checkpoint, its base loaded afresh from model.path, trains step 2 exactly as the first run did
    (same samples, same losses), which a drifting base in the first run would have changed."""
    import shutil

    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    # the merged route: the shared server runs without vLLM's LoRA (test_lora_push: the adapters route)
    lora = ["model.lora.rank=8", "model.lora.alpha=16", "weight_sync.lora=merged", "train.actor_lr=1e-3",
            "rollout.mode=sync",
            "checkpoint.every=1", "checkpoint.keep=3", *remote_engine.overrides]
    first = tmp_path / "lora"
    _, rows = train(tiny_model, first, "train.steps=3", "weight_sync.verify=true", *lora, env=remote_engine.env)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["logprob_mismatch_mean"] < 1e-4 and r["sync_verify_gap"] < 1e-4, r
    adapters = []
    for step in (0, 2):
        actor = first / "checkpoints" / f"step_{step}" / "actor"
        saved = FileSystemReader(str(actor)).read_metadata().state_dict_metadata   # layers stacked per name
        names = {k for k in saved if not k.startswith("optimizer.") and "_extra_state" not in k}
        assert names and all(k.endswith((".lora_a", ".lora_b")) for k in names), sorted(names)[:4]
        assert json.loads((actor / "base.json").read_text())["base"] == str(tiny_model.resolve())
        dcp_to_torch_save(str(actor), str(tmp_path / f"actor{step}.pt"))
        adapters.append({k: v for k, v in torch.load(tmp_path / f"actor{step}.pt").items() if k in names})
    assert all(v.abs().max() > 0 for k, v in adapters[0].items() if k.endswith("lora_b"))   # from zeros
    assert all(not torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])

    second = tmp_path / "resumed"
    (second / "checkpoints").mkdir(parents=True)
    shutil.copytree(first / "checkpoints" / "step_1", second / "checkpoints" / "step_1")
    _, resumed = train(tiny_model, second, "train.steps=3", *lora, env=remote_engine.env)
    assert [r["step"] for r in resumed] == [2]
    got, want = resumed[0], rows[2]
    assert got["reward_mean"] == want["reward_mean"] and got["response_len_mean"] == want["response_len_mean"]
    assert got["policy_loss"] == pytest.approx(want["policy_loss"], abs=1e-5)
    assert got["value_loss"] == pytest.approx(want["value_loss"], rel=1e-4)
