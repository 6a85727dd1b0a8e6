"""Issue 47, the weight push behind generation: the simulator's staged / sharded push
(megarl/sim/push.py), the plan's staging area (plan/transfer.py, plan/engine.py) and
`megarl plan --search` (megarl/sim/search.py)."""
import pytest

from megarl.config import load_config
from megarl.sim.costs import H100, published_models
from megarl.sim.push import WeightSyncCosts

R70 = "recipes/llama3.1_70b.yaml"


def _70b():
    return published_models()["llama3.1-70b"]


def test_staged_pause_is_the_local_load_only_and_below_the_unstaged_pause():
    sync, w = WeightSyncCosts(), _70b().weight_bytes
    for sharded in (False, True):
        staged = sync.push("collective", w, 6, 4, H100, staged=True, sharded=sharded, owners=40)
        unstaged = sync.push("collective", w, 6, 4, H100, staged=False, sharded=sharded, owners=40)
        assert staged.paused_s == pytest.approx(w / 4 / (H100.hbm_bytes_per_s * sync.load_hbm_frac) + sync.fixed_s)
        assert staged.paused_s == pytest.approx(staged.load_s + sync.fixed_s)
        assert staged.paused_s < unstaged.paused_s
        # the wire moves to the trainer side (engines generating), the same seconds
        assert staged.trainer_s == pytest.approx(unstaged.wire_s) and unstaged.trainer_s == 0.0
    assert sync.push("collective", w, 6, 4, H100, staged=True).paused_s <= 0.5


def test_sharded_bytes_per_trainer_link_shrink_with_the_trainer():
    sync, w = WeightSyncCosts(), _70b().weight_bytes
    sends = [sync.push("collective", w, 6, 8, H100, sharded=True, owners=n).send_bytes for n in (1, 8, 40, 80)]
    assert sends == pytest.approx([w, w / 8, w / 40, w / 80])
    assert sync.push("collective", w, 6, 8, H100, sharded=False, owners=80).send_bytes == w
    wires = [sync.push("collective", w, 6, 8, H100, sharded=True, owners=n).wire_s for n in (1, 8, 40)]
    assert wires[0] > wires[1] >= wires[2]
    with pytest.raises(ValueError, match="owners=0"):
        sync.push("collective", w, 6, 8, H100, sharded=True, owners=0)


def test_the_recipe_route_follows_staged_and_sharded():
    from megarl.sim.recipe import roofline_costs
    on = roofline_costs(load_config(R70), "h100", "", 4, 40)
    off = roofline_costs(load_config(R70, ["weight_sync.staged=false", "weight_sync.sharded=false"]), "h100", "", 4, 40)
    assert on[0].load_weights_s <= 0.5 < off[0].load_weights_s
    assert on[1].push_cost.send_bytes == pytest.approx(_70b().weight_bytes / 40)   # TP 8 x PP 5 owners
    assert off[1].push_s == 0.0 and on[1].push_s > 0.0


def test_a_staging_area_that_does_not_fit_is_flagged_naming_the_fix():
    from megarl.plan import format_plan, make_plan
    p = make_plan(load_config(R70))   # 6 engines x TP 4: 32.85 GiB of weights per GPU, twice over 68
    e = p["engine"]
    assert e["staging_bytes"] > 0 and not e["staging_fits"]
    assert "weight_sync.staged=false" in e["staging_warning"] and "\n" not in e["staging_warning"]
    assert "staging area" in format_plan(p)
    fits = make_plan(load_config(R70, ["rollout.engines.tp=8", "rollout.engines.count=3"]))["engine"]
    assert fits["staging_bytes"] == pytest.approx(e["staging_bytes"] / 2) and fits["staging_fits"]
    off = make_plan(load_config(R70, ["weight_sync.staged=false"]))["engine"]
    assert off["staging_bytes"] == 0 and "staging_warning" not in off


def test_search_ranks_by_throughput_with_the_recipes_split():
    from megarl.sim import search
    cfg = load_config(R70)
    result = search.search(cfg, steps=1)
    rows = [r for r in result["rows"] if "tokens_per_s" in r]
    assert [r["tokens_per_s"] for r in rows] == sorted((r["tokens_per_s"] for r in rows), reverse=True)
    own = [r for r in rows if r["recipe"]]
    assert len(own) == 1 and own[0]["split"] == search.recipe_split(cfg)
    assert all(r["fits"] for r in rows if not r["recipe"])   # only splits that fit are simulated
    assert "*" in search.format_search(result, top=1)


def test_plan_search_through_the_cli(capsys):
    from megarl.cli import main
    assert main(["plan", "--search", R70]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line[:4].strip().isdigit()]
    assert any(line[4] == "*" and "6 x 4" in line and " 512 " in line for line in rows)
    tokens = [float(line.split()[-4 if line[4] != "*" else -4]) for line in rows]
    assert tokens == sorted(tokens, reverse=True)


@pytest.mark.parametrize("sharded", [True, False])
def test_a_host_staging_area_counts_every_tensor_whole_and_the_prepared_copy(sharded):
    """On the gloo wire every engine worker stages the model's HF tensors whole: unsharded it
    receives them whole, sharded it assembles the pieces of every sender into full tensors
    (rollout/weights/pieces.py Assembler). Beside them, the version prepared for the swap
    (rollout/weights/shadow.py) is one more copy of the worker's own weights."""
    from megarl.models.arch import resolve_arch
    from megarl.plan import memory as mem
    from megarl.plan.transfer import staging_bytes, staging_place
    cfg = load_config(R70, ["weight_sync.backend=gloo", f"weight_sync.sharded={str(sharded).lower()}"])
    arch = resolve_arch(cfg)[0]
    assert staging_place(cfg) == "host"
    whole = mem.total_params(arch) * mem.DTYPE_BYTES[cfg.model.dtype]
    assert staging_bytes(cfg, arch) == pytest.approx(whole + mem.engine_weight_bytes(arch, cfg.rollout.engines.tp))
