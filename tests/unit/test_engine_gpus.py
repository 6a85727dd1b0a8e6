"""One node of GPUs (rollout/engines/gpus.py): the trainer ranks take the first visible GPUs, the
engines megarl starts get GPUs of their own (by default the rest, rollout.engines.tp each;
rollout.engines.gpus to choose), each server's CUDA_VISIBLE_DEVICES says so, and the weight
backend follows (nccl on GPUs of their own, ipc when they share global rank 0's). Checked on
CPU with a fake device list."""
import pytest

from megarl.config import ConfigError, load_config
from megarl.rollout.engines import gpus
from megarl.rollout.engines.build import build_engines, engine_env, weight_backend
from megarl.rollout.engines.gpus import split_gpus

NODE = [str(i) for i in range(8)]


def config(*overrides):
    return load_config("recipes/tiny_cpu.yaml", list(overrides))


def test_trainer_on_four_engines_on_the_other_four_one_each():
    split = split_gpus(NODE, 4, 4, 1)
    assert split.trainer == ("0", "1", "2", "3")
    assert split.engines == (("4",), ("5",), ("6",), ("7",)) and not split.shared
    assert [split.engine_env(i) for i in range(4)] == [{"CUDA_VISIBLE_DEVICES": g} for g in "4567"]
    assert split.describe() == "trainer GPUs 0,1,2,3 | engine 0: 4 | engine 1: 5 | engine 2: 6 | engine 3: 7"


def test_engine_tp_takes_consecutive_gpus_and_ids_are_the_visible_ones():
    split = split_gpus(["2", "3", "5", "6", "7", "9"], 2, 2, 2)
    assert split.trainer == ("2", "3") and split.engines == (("5", "6"), ("7", "9"))
    assert split.engine_env(1) == {"CUDA_VISIBLE_DEVICES": "7,9"}


def test_chosen_gpus():
    assert split_gpus(NODE, 4, 2, 1, [7, 6]).engines == (("7",), ("6",))


def test_no_gpu_left_shares_rank_0_s_gpu_as_before():
    split = split_gpus(["0"], 1, 2, 1)
    assert split.shared and split.engine_env(0) == {} and split.engines == (("0",), ("0",))


@pytest.mark.parametrize("args,says", [
    ((NODE, 4, 8, 1), "need 8 GPUs of their own"),
    ((NODE, 4, 2, 1, [3, 4]), "overlaps the trainer's GPUs"),
    ((NODE, 4, 2, 1, [4, 9]), "not among this node's visible GPUs"),
    ((NODE, 4, 2, 1, [4, 4]), "listed twice"),
    ((NODE, 4, 2, 2, [4, 5, 6]), "3 GPUs for 2 engines"),
    ((NODE, 9, 1, 1), "9 trainer ranks"),
])
def test_refused_in_one_line(args, says):
    with pytest.raises(ConfigError) as err:
        split_gpus(*args)
    assert says in str(err.value) and "\n" not in str(err.value)


@pytest.fixture
def fake_node(monkeypatch):
    """A node of 8 GPUs seen from a CPU machine, 4 trainer ranks on it."""
    monkeypatch.setattr(gpus, "visible_gpus", lambda: list(NODE))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")


def test_each_local_server_gets_its_gpu(fake_node, tmp_path):
    cfg = config("rollout.engines.mode=local_servers", "rollout.engines.count=4")
    servers = [e.server for e in build_engines(cfg.rollout, "model", 0, str(tmp_path))]
    assert [s.env()["CUDA_VISIBLE_DEVICES"] for s in servers] == ["4", "5", "6", "7"]
    assert all("VLLM_CPU_OMP_THREADS_BIND" not in s.extra_env for s in servers)


def test_in_process_engines_get_theirs_and_the_chosen_ones(fake_node):
    cfg = config("rollout.engines.count=2", "rollout.engines.gpus=[6,7]")
    assert [engine_env(cfg.rollout, i)["CUDA_VISIBLE_DEVICES"] for i in range(2)] == ["6", "7"]
    with pytest.raises(ConfigError, match="overlaps the trainer's GPUs"):
        engine_env(config("rollout.engines.count=2", "rollout.engines.gpus=[0,7]").rollout, 0)


def test_the_backend_follows_the_split(fake_node):
    cfg = config("rollout.engines.mode=local_servers", "rollout.engines.count=4")
    ws = cfg.weight_sync
    assert gpus.own_gpus(cfg.rollout.engines)
    assert ws.resolved_backend(True, "local_servers", own_gpus=True) == "nccl"
    assert ws.resolved_backend(True, "local_servers", own_gpus=False) == "ipc"
    assert ws.resolved_backend(True, "remote") == "nccl"
    assert weight_backend(ws, "local_servers", True) == "gloo"   # this machine has no CUDA
    ipc = config("weight_sync.backend=ipc").weight_sync
    with pytest.raises(ConfigError, match="GPUs of their own"):
        ipc.check_engines(True, "local_servers", 1, own_gpus=True)


def test_without_cuda_nothing_changes(tmp_path):
    cfg = config("rollout.engines.mode=local_servers", "rollout.engines.count=2")
    assert gpus.node_split(cfg.rollout.engines) is None
    assert all("CUDA_VISIBLE_DEVICES" not in engine_env(cfg.rollout, i) for i in range(2))


def test_remote_servers_take_no_gpus_setting():
    with pytest.raises(ConfigError, match="rollout.engines.gpus"):
        config("rollout.engines.mode=remote", "rollout.engines.urls=[http://node1:8000]", "rollout.engines.gpus=[1]")
