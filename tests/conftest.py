"""Shared fixtures: the tiny model (built once per machine), a subprocess runner, one vLLM
server per test process for the runs that do not test engines, a small disk."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.bootstrap import bootstrap

# before any test module is collected: test files import megarl modules that import megatron
bootstrap()

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # tools/ helpers (tools.model_positions), however pytest was started
    sys.path.insert(0, str(ROOT))
TINY = ROOT / "artifacts" / "tiny_countdown"

# The files that take minutes (vLLM engine starts, torchrun launches), longest first, as
# measured with `--durations` under `make test`. pytest-xdist (`--dist loadfile
# --no-loadscope-reorder`) hands files to its workers in collection order: starting the long
# ones first and ending with the many short ones keeps both workers busy to the end, where
# xdist's default order (most tests first) left a one-test file of 7 minutes for last.
LONGEST_FIRST = [
    "tests/e2e/test_engine_failure.py", "tests/e2e/test_slurm.py", "tests/dist/test_conversion_tools.py",
    "tests/e2e/test_train_cli.py", "tests/e2e/test_agents.py", "tests/dist/test_layouts.py",
    "tests/e2e/test_crash_resume.py", "tests/e2e/test_chaos.py", "tests/e2e/test_eval.py",
    "tests/dist/test_megatron_load.py", "tests/dist/test_hf_export.py", "tests/e2e/test_pool_sync.py",
    "tests/e2e/test_http_engine.py",
    "tests/e2e/test_request_errors.py", "tests/dist/test_token_budget.py",
    "tests/dist/test_model_families.py", "tests/e2e/test_partial_rollout.py", "tests/e2e/test_extensions.py",
    "tests/dist/test_moe_layouts.py", "tests/dist/test_routing_replay.py", "tests/e2e/test_moe_train.py",
    "tests/e2e/test_moe_routes.py", "tests/dist/test_moe_metrics.py",
    "tests/e2e/test_bad_inputs.py",
    "tests/unit/test_job_layout.py",
    "tests/dist/test_plan_moe_memory.py",
    "tests/dist/test_reward_model.py", "tests/e2e/test_disk_full.py", "tests/dist/test_device_placement.py",
    "tests/e2e/test_math_data.py", "tests/dist/test_overlap.py", "tests/dist/test_nonfinite.py",
]


@pytest.fixture(autouse=True, scope="session")
def _servers_in_a_new_session():
    """MEGARL_TEST_SERVERS_NEW_SESSION=1 (tools/engine_tests_under_stress.sh): the servers the
    tests start get a session of their own, as megarl started them before, to see whether a
    test depends on how fast their streams arrive."""
    if os.environ.get("MEGARL_TEST_SERVERS_NEW_SESSION") != "1":
        yield
        return
    from megarl.rollout.engines import servers
    mp = pytest.MonkeyPatch()
    mp.setattr(servers.LocalServer, "popen_group",
               staticmethod(lambda: {"start_new_session": True, "preexec_fn": servers._die_with_parent}))
    yield
    mp.undo()


def pytest_collection_modifyitems(config, items):
    """Longest files first (LONGEST_FIRST), then the rest in their usual order; a file's tests
    stay together and in order (module fixtures, and tests that rely on running last)."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


VLLM_SERVER = "vllm.entrypoints.openai.api_server"


def tiny_reward_model(path: Path, vocab: int) -> Path:
    """A tiny random Qwen2 sequence classifier (one label) saved in `path`: the reward model of
    the tests that score on the trainer ranks."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    model = Qwen2ForSequenceClassification(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    return path


def is_vllm_server(argv: list[str], parent_argv: list[str]) -> bool:
    """A vLLM API server process, not one of its own forks (caught between fork and exec, a
    fork still shows the server's argv)."""
    return VLLM_SERVER in argv and VLLM_SERVER not in parent_argv


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The demo's tiny countdown model (tools/make_tiny_model.py is idempotent: a no-op when built).
    Under pytest-xdist every worker runs this fixture: the lock lets one build it while the
    others wait, instead of two writing the same folder."""
    from filelock import FileLock

    TINY.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(TINY) + ".lock"):
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "--out", str(TINY)],
                       check=True, cwd=ROOT)
    return TINY


@pytest.fixture(scope="session")
def remote_engine(tiny_model, tmp_path_factory):
    """A vLLM server on the tiny model, for the end-to-end runs that test something other than
    the engines (crash consistency, disk full, data, loading): `megarl train ...
    *remote_engine.overrides` uses it as `rollout.engines.mode=remote`, as a cluster job does,
    instead of starting an in-process engine of its own (~40 s of CPU per run, most of it
    imports). Every run pushes its own weights before it generates, and a run killed
    mid-sync leaves it paused, which the next run's first push ends: runs need nothing reset.
    One per test process (pytest-xdist worker); the key goes through the environment."""
    import secrets
    from types import SimpleNamespace

    from megarl.rollout.engines.servers import LocalServer

    log = tmp_path_factory.mktemp("remote_engine") / "engine_0.log"
    server = LocalServer(tiny_model, log, api_key=secrets.token_hex(16), seed=0, max_model_len=256,
                         kv_cache_mb=64, weight_backend="gloo")   # runs push over the wire (the default)
    server.start()
    try:
        server.wait_healthy(600)
        yield SimpleNamespace(server=server, env={"MEGARL_ENGINE_API_KEY": server.api_key},
                              overrides=["rollout.engines.mode=remote", f"rollout.engines.urls=[{server.url}]"])
    finally:
        server.stop()


def run_py(args, timeout=900, env=None, **kw) -> subprocess.CompletedProcess:
    """Run a Python entry point from the repo root in a fresh process (megatron's CPU shim and
    vLLM change process-wide state, so end-to-end runs never share the pytest process)."""
    full_env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=full_env, capture_output=True,
                          text=True, timeout=timeout, **kw)


@pytest.fixture
def small_disk(tmp_path):
    """A factory: small_disk(mb) mounts a tmpfs of that size (a disk that fills) and returns its
    path; unmounted at teardown. Skips where this process may not mount (it needs root)."""
    mounted = []

    def make(mb: int) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m,mode=0700", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode})")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)
