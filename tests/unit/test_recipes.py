"""Every recipe in recipes/ loads and validates against the schema (a recipe added later is
picked up by the glob). Big models' checkpoints are not here: the config is checked, not files."""
from pathlib import Path

import pytest

from megarl.config import load_config, validate_world
from megarl.plan import make_plan, resolve_arch
from megarl.plan.memory import total_params
from megarl.sim.costs import published_models
from megarl.sim.recipe import roofline_model

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p for p in (ROOT / "recipes").glob("*.yaml") if p.name != "base.yaml")
MODEL_FACTS = sorted((ROOT / "recipes" / "models").glob("*.yaml"))


def test_recipes_are_found():
    names = {p.name for p in RECIPES}
    assert {"tiny_cpu.yaml", "qwen2.5_7b.yaml", "qwen2.5_32b.yaml", "llama3.1_70b.yaml"} <= names


@pytest.mark.parametrize("recipe", RECIPES + [ROOT / "recipes" / "base.yaml"], ids=lambda p: p.name)
def test_recipe_loads_and_validates(recipe):
    """Schema checks (__post_init__) pass; on the recipe's own cluster the trainer layout
    splits the launched ranks and the batch into micro-batches (validate_world)."""
    cfg = load_config(recipe)
    c = cfg.cluster
    world = c.trainer_node_count * c.gpus_per_node if c.gpus_per_node else 1
    if c.gpus_per_node:
        assert validate_world(cfg, world) >= 1
        assert cfg.rollout.engines.count * cfg.rollout.engines.tp <= c.engine_nodes * c.gpus_per_node


@pytest.mark.parametrize("recipe", [p for p in RECIPES if load_config(p).cluster.gpus_per_node],
                         ids=lambda p: p.name)
def test_cluster_recipe_names_its_hardware_and_fits(recipe):
    """A cluster recipe opens with a comment naming the hardware, its model facts are given
    (no checkpoint needed to plan), and `megarl plan` finds it fits on that hardware."""
    text = recipe.read_text()
    header = text.split("defaults:")[0]
    assert header.startswith("#") and "Sized for" in header and "TP=" in header and "engine TP" in header
    cfg = load_config(recipe)
    assert cfg.model.arch.given
    assert str(cfg.cluster.nodes) in header and str(cfg.parallel.tp) in header
    plan = make_plan(cfg)
    assert plan["fits"], plan["problems"]


@pytest.mark.parametrize("facts", MODEL_FACTS, ids=lambda p: p.name)
def test_model_facts_load_alone_and_feed_the_simulator(facts):
    """recipes/models/*.yaml are schema-valid on their own, and are the simulator's roofline
    models (one table of model facts for plan and simulate)."""
    cfg = load_config(facts)
    arch, _ = resolve_arch(cfg)
    m = published_models()[facts.stem.replace("_", "-")]
    assert (m.layers, m.hidden, m.kv_heads, m.head_dim) == (arch.layers, arch.hidden, arch.kv_heads, arch.head_dim)
    assert m.params == total_params(arch)


@pytest.mark.parametrize("recipe", [p for p in RECIPES if load_config(p).model.arch.given], ids=lambda p: p.name)
def test_simulate_defaults_to_the_recipes_own_model(recipe):
    cfg = load_config(recipe)
    arch, _ = resolve_arch(cfg)
    assert roofline_model(cfg).params == total_params(arch)
