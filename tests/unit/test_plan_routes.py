"""Routing replay's routes in `megarl plan` (megarl/plan/routes.py, trainer.py, report.py): the
engines' routes on the controller's host, the trainer's batch of routes and int64 indices per
GPU, on hand-computed cases; none with replay off or a dense model."""
from dataclasses import replace

import pytest

from megarl.config import load_config
from megarl.models.arch import Arch, resolve_arch
from megarl.plan import format_plan, make_plan, routes
from megarl.plan.trainer import Layout, trainer_memory

DENSE = Arch(hidden=4, layers=2, heads=2, kv_heads=1, head_dim=2, ffn=8, vocab=16)
# layer 0 dense, layer 1 MoE: 4 experts, top-2
MOE = Arch(hidden=4, layers=2, heads=2, kv_heads=1, head_dim=2, ffn=8, vocab=16, experts=4, top_k=2, moe_ffn=3,
           dense_layers=(0,))
RECIPE = "recipes/qwen3_30b_a3b.yaml"


def test_host_routes_by_hand():
    # 8 samples of at most 10 tokens: 9 input tokens each, 1 MoE layer, top-2, 1 byte
    assert routes.host_route_bytes("r3", MOE, samples=8, seq=10) == 8 * 9 * 1 * 2
    assert routes.host_route_bytes("r2", MOE, 8, 10) == 0      # r2 records its own: the engines capture none
    assert routes.host_route_bytes("off", MOE, 8, 10) == 0
    assert routes.host_route_bytes("r3", DENSE, 8, 10) == 0


def test_device_routes_by_hand():
    # r3: the batch of every MoE layer's routes (8 x 10 x 1 x 2 bytes) + int64 indices of the
    # old-logprob pass over this DP rank's 8 / 2 rows
    both = range(2)
    assert routes.device_route_bytes("r3", MOE, 8, 10, dp=2, stage_layers=both) == 8 * 10 * 2 + 4 * 10 * 2 * 8
    # sequence parallelism over TP=2: each rank's router sees half the positions
    assert routes.device_route_bytes("r3", MOE, 8, 10, 2, both, tp_split=2) == 8 * 10 * 2 + 4 * 5 * 2 * 8
    # PP stage holding only the dense layer: r3 still holds the whole batch, no indices; r2 nothing
    assert routes.device_route_bytes("r3", MOE, 8, 10, 2, [0]) == 8 * 10 * 2
    assert routes.device_route_bytes("r2", MOE, 8, 10, 2, [0]) == 0
    assert routes.device_route_bytes("r2", MOE, 8, 10, 2, [1]) == 8 * 10 * 2 + 4 * 10 * 2 * 8
    assert routes.device_route_bytes("off", MOE, 8, 10, 2, both) == 0
    assert routes.device_route_bytes("r3", DENSE, 8, 10, 2, both) == 0


def test_more_than_256_experts_take_two_bytes_per_id():
    many = replace(MOE, experts=300)
    assert routes.id_bytes(MOE) == 1 and routes.id_bytes(replace(MOE, experts=256)) == 1
    assert routes.host_route_bytes("r3", many, 8, 10) == 2 * routes.host_route_bytes("r3", MOE, 8, 10)


@pytest.mark.parametrize("mode", ["r2", "r3"])
def test_trainer_peak_counts_the_routes(mode):
    """The recipe's peak per trainer GPU grows by exactly the routes' bytes, in every phase."""
    over = [f"algo.routing_replay={mode}", "rollout.overlap=false"]
    cfg, off = load_config(RECIPE, over), load_config(RECIPE, ["rollout.overlap=false"])
    arch = resolve_arch(cfg)[0]
    lay = Layout(tp=1, pp=1, dp=16, ep=8, etp=1)
    with_routes, without = trainer_memory(cfg, arch, lay), trainer_memory(off, arch, lay)
    seq = cfg.rollout.engines.max_model_len
    held = cfg.samples_per_step * seq * 48 * 8 + cfg.samples_per_step / 16 * seq * 48 * 8 * 8   # 48 MoE layers, top-8
    assert with_routes["roles"]["routes"] == held and without["roles"]["routes"] == 0
    assert all(with_routes["phases"][k] - without["phases"][k] == held for k in without["phases"])
    host = cfg.samples_per_step * (seq - 1) * 48 * 8 if mode == "r3" else 0
    assert with_routes["route_host_bytes"] == host and without["route_host_bytes"] == 0


def test_plan_prints_routes_only_with_replay():
    shown = format_plan(make_plan(load_config(RECIPE, ["algo.routing_replay=r3"])))
    assert "routes" in shown and "global rank 0's host also holds" in shown
    plain = format_plan(make_plan(load_config(RECIPE)))
    assert "routes" not in plain
    assert make_plan(load_config(RECIPE, ["algo.routing_replay=r3"]))["per_gpu_bytes"]["routes"] > 0
