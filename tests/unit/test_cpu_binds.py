"""CPU engines get cores of their own (vllm_settings.cpu_binds, build.engine_env): with vLLM's
`auto` binding every engine on a machine pinned its workers to the same first core, so two
engines generated and loaded weights one after the other on one core."""
import pytest

from megarl.config import load_config
from megarl.rollout.engines import build
from megarl.rollout.engines.servers import LocalServer
from megarl.rollout.engines.vllm_settings import BIND_ENV, cpu_binds


@pytest.mark.parametrize("engines,tp,cpus,want", [
    (1, 1, [0, 1], None),                                # one worker: vLLM's auto (reserves a core)
    (2, 1, [0, 1], ["0", "1"]),
    (2, 1, list(range(16)), ["0-7", "8-15"]),
    (1, 2, [0, 1, 2, 3], ["0-1|2-3"]),                  # TP workers of one engine: "|" apart
    (2, 2, [4, 5, 6, 7, 9], ["4|5", "6|7,9"]),          # the affinity set need not be contiguous
    (3, 1, [0, 1], ["0", "1", "0"]),                     # more workers than cores: round-robin
    (2, 1, [], None),
])
def test_cpu_binds_split_the_cores_between_every_engines_workers(engines, tp, cpus, want):
    assert cpu_binds(engines, tp, cpus) == want


def test_no_two_workers_share_a_core_while_cores_last():
    for engines in range(1, 5):
        for tp in (1, 2):
            binds = cpu_binds(engines, tp, list(range(8)))
            if binds is None:
                continue
            slots = [w for b in binds for w in b.split("|")]
            assert len(slots) == engines * tp
            cores = [c for s in slots for c in _ids(s)]
            assert len(cores) == len(set(cores)) and set(cores) <= set(range(8))


def _ids(text):
    out = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def test_engines_megarl_starts_get_their_bind_and_a_user_bind_wins(monkeypatch, tmp_path):
    monkeypatch.setattr(build.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv(BIND_ENV, raising=False)
    cfg = load_config("recipes/tiny_cpu.yaml", ["rollout.engines.count=2"]).rollout
    inproc = [build.build_engine(cfg, "m", 0, str(tmp_path), i, "gloo") for i in range(2)]
    assert [e.env for e in inproc] == [{BIND_ENV: "0"}, {BIND_ENV: "1"}]
    cfg.engines.mode = "local_servers"
    server = build.build_engine(cfg, "m", 0, str(tmp_path), 1, "gloo").server
    assert isinstance(server, LocalServer) and server.env()[BIND_ENV] == "1"
    monkeypatch.setenv(BIND_ENV, "0|1")                 # the user's own binding is kept as it is
    assert build.engine_env(cfg, 1) == {}
    assert build.build_engine(cfg, "m", 0, str(tmp_path), 1, "gloo").server.env()[BIND_ENV] == "0|1"
    monkeypatch.setenv(BIND_ENV, "auto")
    single = load_config("recipes/tiny_cpu.yaml", []).rollout
    assert build.engine_env(single, 0) == {}            # one engine: vLLM's own choice
