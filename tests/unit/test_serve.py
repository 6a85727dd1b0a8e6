"""`python -m megarl.rollout.engines.serve`: the cluster scripts' vLLM server (same argv as LocalServer)
and their health wait."""
import json
import subprocess
import sys
import time

import pytest
import torch

from megarl.config.schema import EnginesConfig, RolloutConfig
from megarl.rollout.engines import serve, vllm_async
from megarl.rollout.engines.servers import LocalServer


@pytest.fixture
def captured(monkeypatch):
    """os.execve replaced: what serve would have become."""
    got = {}

    def fake_execve(path, argv, env):
        got.update(path=path, argv=list(argv), env=dict(env))
        raise SystemExit(0)
    monkeypatch.setattr(serve.os, "execve", fake_execve)
    return got


@pytest.mark.parametrize("route,rank", [("adapters", 8), ("merged", 0)])
def test_serve_of_a_lora_recipe_serves_the_adapters_when_they_travel_alone(captured, monkeypatch, route, rank):
    """The cluster's servers of a LoRA recipe: vLLM's LoRA on (the rank rounded up to one vLLM
    takes) exactly when weight_sync.lora=adapters; merged weights need none."""
    monkeypatch.setenv("MEGARL_ENGINE_API_KEY", "k" * 32)
    with pytest.raises(SystemExit):
        serve.main(["serve", "recipes/tiny_lora_cpu.yaml", "model.lora.rank=5", f"weight_sync.lora={route}",
                    "--host", "10.1.2.3", "--port", "8123"])
    argv = captured["argv"]
    assert ("--enable-lora" in argv) == bool(rank)
    if rank:
        assert argv[argv.index("--max-lora-rank") + 1] == str(rank) and argv[argv.index("--max-loras") + 1] == "1"


def test_serve_execs_the_local_server_command_with_the_key_in_the_environment(captured, monkeypatch):
    monkeypatch.setenv("MEGARL_ENGINE_API_KEY", "k" * 32)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    with pytest.raises(SystemExit):
        serve.main(["serve", "recipes/tiny_cpu.yaml", "rollout.engines.kv_cache_mb=32", "--host", "10.1.2.3",
                    "--port", "8123", "--index", "2", "run.seed=5"])
    want = LocalServer("artifacts/tiny_countdown", "/dev/null", api_key="", seed=7, max_model_len=256,
                       kv_cache_mb=32, port=8123, host="10.1.2.3", weight_backend="gloo").command()
    assert captured["argv"] == want
    argv = captured["argv"]
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert "--no-use-tqdm-on-load" in argv   # no bar redraws ("\r") in the server's log file
    # the recipe's weight_sync.transport=collective: the server takes weights over the wire,
    # and every route but /health needs the key
    assert argv[argv.index("--weight-transfer-config") + 1] == '{"backend": "gloo"}'
    # the held-token and LoRA adapter routes, then the key check: vLLM adds them in order, the
    # last outermost
    middleware = [argv[i + 1] for i, a in enumerate(argv) if a == "--middleware"]
    assert middleware == ["megarl.rollout.engines.held_tokens.HeldTokensRoute",
                          "megarl.rollout.engines.lora_slots.AdapterRoute",
                          "megarl.rollout.engines.auth.RequireKey"]
    assert "--api-key" not in argv and "k" * 32 not in " ".join(argv)
    env = captured["env"]
    assert env["VLLM_API_KEY"] == "k" * 32 and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert "MEGARL_ENGINE_API_KEY" not in env and "VLLM_CPU_KVCACHE_SPACE" not in env


@pytest.mark.parametrize("host,key,fragment", [("0.0.0.0", "x" * 32, "cluster-internal"),
                                               ("10.1.2.3", "", "MEGARL_ENGINE_API_KEY")])
def test_serve_refuses_a_wildcard_address_or_no_key(captured, monkeypatch, capsys, host, key, fragment):
    monkeypatch.setenv("MEGARL_ENGINE_API_KEY", key)
    assert serve.main(["serve", "recipes/tiny_cpu.yaml", "--host", host, "--port", "8123"]) == 2
    assert fragment in capsys.readouterr().err and not captured


def test_serve_rejects_a_bad_override(captured, monkeypatch, capsys):
    monkeypatch.setenv("MEGARL_ENGINE_API_KEY", "x" * 32)
    assert serve.main(["serve", "recipes/tiny_cpu.yaml", "train.stepz=1", "--host", "h", "--port", "1"]) == 2
    assert "train.stepz" in capsys.readouterr().err and not captured


def test_wait_times_out_with_the_log_tail(tmp_path, capsys):
    log = tmp_path / "engine_0.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    t0 = time.monotonic()
    assert serve.main(["wait", "--timeout", "1", "--interval", "0.2", f"http://127.0.0.1:9={log}"]) == 1
    assert time.monotonic() - t0 < 30
    err = capsys.readouterr().err
    assert "not healthy after 1 s" in err and "line 99" in err and "line 10\n" not in err


def test_wait_stops_when_a_watched_process_exits(tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    t0 = time.monotonic()
    assert serve.main(["wait", "--timeout", "600", "--watch-pid", str(dead.pid),
                       f"http://127.0.0.1:9={tmp_path / 'missing.log'}"]) == 1
    assert time.monotonic() - t0 < 30
    assert f"process {dead.pid} exited" in capsys.readouterr().err


def _flags(argv: list[str]) -> dict:
    """vLLM command-line flags back to AsyncEngineArgs-style names: `--x v` -> x: "v",
    `--x` -> x: True, `--no-x` -> x: False."""
    out, i = {}, 0
    while i < len(argv):
        name = argv[i][2:].replace("-", "_")
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[name], i = argv[i + 1], i + 2
        elif name.startswith("no_"):
            out[name[3:]], i = False, i + 1
        else:
            out[name], i = True, i + 1
    return out


@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize("backend", ["", "gloo"])
@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_in_process_engines_and_servers_get_the_same_vllm_settings(monkeypatch, cuda, backend, eager, lora_rank):
    """vllm_settings.engine_settings is rendered once to AsyncEngineArgs keywords
    (in-process engines) and once to the server's flags (LocalServer, and so `serve`): every
    setting reaches both with the same value (no weight-loading bar either); besides them the
    in-process engine adds only its quiet stats and the server only its address, name and key
    middleware."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    cfg = RolloutConfig(engines=EnginesConfig(enforce_eager=eager, kv_cache_mb=32, max_model_len=192,
                                             gpu_memory_utilization=0.3))
    in_process = vllm_async.engine_args(cfg, seed=5, index=2, weight_backend=backend, lora_rank=lora_rank)
    server = LocalServer("m", "/dev/null", api_key="", seed=7, max_model_len=cfg.engines.max_model_len,
                         tp=cfg.engines.tp, enforce_eager=cfg.engines.enforce_eager,
                         kv_cache_mb=cfg.engines.kv_cache_mb,
                         gpu_memory_utilization=cfg.engines.gpu_memory_utilization, port=8123, weight_backend=backend,
                         lora_rank=lora_rank)
    argv = server.command()
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    flags = _flags(argv[3:])
    shared = {k: v for k, v in in_process.items() if k != "disable_log_stats"}
    assert set(flags) - set(shared) == {"model", "host", "port", "served_model_name", "middleware"}
    for name, value in shared.items():
        got = flags[name]
        if isinstance(value, bool):
            assert got is value, name
        elif isinstance(value, dict):
            assert json.loads(got) == value, name
        else:
            assert got == str(value), name
    assert shared["logprobs_mode"] == "processed_logprobs" and shared["seed"] == 7 and flags["enforce_eager"] is eager
    assert ("weight_transfer_config" in shared) == bool(backend)
    # an adapters push's engines: vLLM's LoRA, one slot, its rank rounded up to one vLLM takes
    lora = {k: shared.get(k) for k in ("enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras")}
    assert lora == ({"enable_lora": True, "max_lora_rank": 8, "max_loras": 1, "max_cpu_loras": 1} if lora_rank
                    else dict.fromkeys(lora))
    if cuda:
        assert shared["dtype"] == "auto" and shared["gpu_memory_utilization"] == 0.3
    else:
        assert shared["dtype"] == "float32" and shared["kv_cache_memory_bytes"] == 32 << 20
        assert shared["enable_chunked_prefill"] is False
    assert in_process["disable_log_stats"] is True
