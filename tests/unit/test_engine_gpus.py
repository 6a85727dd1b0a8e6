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


ONE_NODE = ("cluster.gpus_per_node=8", "rollout.engines.mode=local_servers", "rollout.engines.count=4")


def test_the_plan_of_a_one_node_recipe_prints_the_split_its_servers_get(fake_node, tmp_path, capsys):
    """`megarl plan`: trainer on GPUs 0-3, engine i on 4+i, as each server's environment says
    on that node (4 trainer ranks), and the trainer's layout over those 4 GPUs."""
    from megarl import cli
    from megarl.plan import make_plan
    assert cli.main(["plan", "recipes/tiny_cpu.yaml", *ONE_NODE]) == 0
    printed = capsys.readouterr().out
    line = "GPU split: trainer GPUs 0,1,2,3 | engine 0: 4 | engine 1: 5 | engine 2: 6 | engine 3: 7"
    assert line in printed, printed
    plan = make_plan(config(*ONE_NODE))
    split = plan["placement"]["gpu_split"]
    assert split["trainer"] == ["0", "1", "2", "3"] and not split["shared"]
    assert plan["placement"]["trainer"]["gpus"] == 4 and plan["placement"]["trainer"]["dp"] == 4
    assert plan["engine"] is not None   # the engines' GPUs are planned too
    servers = [e.server for e in build_engines(config(*ONE_NODE).rollout, "model", 0, str(tmp_path))]
    assert [[s.env()["CUDA_VISIBLE_DEVICES"]] for s in servers] == split["engines"]


def test_the_plan_follows_named_gpus_and_refuses_an_overlap_in_one_line():
    from megarl.plan import make_plan
    named = make_plan(config(*ONE_NODE[:2], "rollout.engines.count=2", "rollout.engines.gpus=[6,7]"))
    assert named["placement"]["gpu_split"]["line"] == "trainer GPUs 0,1,2,3,4,5 | engine 0: 6 | engine 1: 7"
    alone = make_plan(config("cluster.gpus_per_node=1"))   # nothing left: the engine shares rank 0's GPU
    assert alone["placement"]["gpu_split"]["shared"] and alone["placement"]["trainer"]["gpus"] == 1
    with pytest.raises(ConfigError, match="rollout.engines.gpus=.*listed twice"):
        make_plan(config(*ONE_NODE[:2], "rollout.engines.count=2", "rollout.engines.gpus=[6,6]"))
    odd = make_plan(config("cluster.gpus_per_node=8", "parallel.tp=2"))   # one engine leaves 7 GPUs to TP=2
    assert odd["placement"]["gpu_split"]["trainer"] == [str(i) for i in range(7)] and not odd["fits"]
    assert "divide the trainer's 7 (those of its 8 the engines leave on the node)" in odd["problems"][0]["what"]
