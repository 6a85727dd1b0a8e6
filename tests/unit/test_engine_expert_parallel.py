"""vLLM expert parallelism for the engines megarl starts (rollout.engines.expert_parallel): the
settings that refuse it, the engine arguments and server flags that carry it, and the plan's
engine memory with it."""
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from megarl.config import ConfigError, load_config


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
