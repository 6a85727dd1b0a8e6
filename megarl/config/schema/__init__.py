"""The one place megarl's config defaults live.

Recipes (YAML) only override fields declared here. Each field's docstring-comment gives its
meaning and unit; `__post_init__` checks what can be checked without knowing the world size
(`validate_world` does the rest once the ranks are up). Errors name the key, the value and the
fix, and are raised before anything expensive starts.
"""
from megarl.config.errors import ConfigError
from megarl.config.schema.agents import EnvConfig, ServiceConfig
from megarl.config.schema.algo import AlgoConfig, TrainConfig
from megarl.config.schema.data import DataConfig, RewardConfig
from megarl.config.schema.eval import EvalConfig
from megarl.config.schema.model import ArchConfig, LoraConfig, ModelConfig, ParallelConfig, RunConfig
from megarl.config.schema.rollout import LOCAL_ENGINE_MODES, EnginesConfig, PartialConfig, RolloutConfig, SamplingConfig
from megarl.config.schema.root import RootConfig, validate_world
from megarl.config.schema.run import CheckpointConfig, ClusterConfig, MetricsConfig, WeightSyncConfig

__all__ = [
    "ConfigError",
    "RunConfig",
    "ArchConfig",
    "ModelConfig",
    "LoraConfig",
    "ParallelConfig",
    "AlgoConfig",
    "TrainConfig",
    "SamplingConfig",
    "LOCAL_ENGINE_MODES",
    "EnginesConfig",
    "PartialConfig",
    "RolloutConfig",
    "EnvConfig",
    "ServiceConfig",
    "DataConfig",
    "RewardConfig",
    "EvalConfig",
    "WeightSyncConfig",
    "MetricsConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "RootConfig",
    "validate_world",
]
