"""Config: the dataclass schema (the only place defaults live) and the omegaconf loader."""
from megarl.config.loader import load_config, save_config
from megarl.config.schema import ConfigError, RootConfig, validate_world

__all__ = ["ConfigError", "RootConfig", "load_config", "save_config", "validate_world"]
