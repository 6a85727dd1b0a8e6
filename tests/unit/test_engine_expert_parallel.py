"""vLLM expert parallelism for the engines megarl starts (rollout.engines.expert_parallel): the
settings that refuse it, the engine arguments and server flags that carry it, and the plan's
engine memory with it."""
import pytest

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
    assert "rollout.engines.expert_parallel=True" in line and says in line and "\n" not in line


def test_expert_parallel_loads_with_engine_tp():
    assert config("rollout.engines.expert_parallel=true", "rollout.engines.tp=2").rollout.engines.expert_parallel
    assert not config().rollout.engines.expert_parallel
