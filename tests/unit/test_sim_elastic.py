"""The simulator models elastic steps (rollout.partial.max_step_multiple) and prints each mode's
ceiling: at a bounded staleness the engines stay busy, a step trains a whole multiple of
groups_per_step, and the figures are per groups_per_step groups so modes compare."""
from test_simulator import Linear

from megarl.sim.costs import MeasuredTrainer
from megarl.sim.recipe import add_ceilings, format_table
from megarl.sim.run import SimSettings, simulate
from megarl.sim.workload import Workload, parse_dist


def _run(multiple: int, mode: str = "partial") -> dict:
    w = Workload(parse_dist("lognormal:mu=3,sigma=1.2"), n=4, max_len=200, seed=1)
    return simulate(SimSettings(mode=mode, steps=8, groups_per_step=2, concurrency=16, max_staleness=2,
                                max_step_multiple=multiple), w, Linear(a=0.01), MeasuredTrainer(0.05, 1e-4))


def slots_used(out: dict) -> float:
    steps = out["per_step"]
    return sum(s["rollout_inflight_mean"] * s["rollout_s"] for s in steps) / sum(s["rollout_s"] for s in steps) / 16


def test_elastic_steps_keep_the_engines_busy_within_the_bound():
    fixed, elastic = _run(1), _run(8)
    assert elastic["staleness_max"] <= 2 and fixed["staleness_max"] <= 2
    assert all(s["trained_samples"] % 8 == 0 and 8 <= s["trained_samples"] <= 64 for s in elastic["per_step"])
    assert any(s["trained_samples"] > 8 for s in elastic["per_step"])
    assert all(s["trained_samples"] == 8 for s in fixed["per_step"])
    assert slots_used(elastic) > 0.95 > 0.8 > slots_used(fixed)   # requests in flight during rounds / 16
    assert elastic["unit_s"] < fixed["unit_s"]            # seconds per groups_per_step groups
    assert elastic["units"] == elastic["trained_samples"] / 8


def test_each_mode_is_printed_beside_its_ceiling():
    modes = {m: _run(8, m) for m in ("sync", "partial", "async")}
    figures = {m: {**r, "step_s_mean": r["wall_s"] / r["steps"], "rollout_unit_s": r["rollout_unit_s"],
                   "groups_per_step_mean": r["groups_trained"] / r["steps"],
                   "requests_per_trained_sample": 1.0, "reprefill_tokens": 0, "multi_version_tokens": 0,
                   "overlap_s_mean": 0.0} for m, r in modes.items()}
    add_ceilings(figures)
    assert figures["sync"]["speedup"] == 1.0
    for m in figures.values():
        assert m["ceiling"] > 0 and m["of_ceiling"] == m["speedup"] / m["ceiling"]
    table = format_table({"recipe_mode": "partial", "modes": figures,
                          "weight_sync": {"route": "x", "trainer_s": 0.0, "engine_s": 0.0}})
    assert "of ceiling" in table
    lines = table.splitlines()
    for mode, m in figures.items():   # each mode's row: its speedup, beside its ceiling and the share of it
        row = [ln.split() for ln in lines if ln.split()[:1] == [mode] and len(ln.split()) == 5]
        assert row and [float(x) for x in row[0][1:4]] == [round(m[k], 2) for k in ("speedup", "ceiling",
                                                                                   "of_ceiling")], (mode, row)
