"""Recipe loading: schema defaults <- recipe chain (`defaults:`) <- command-line `key=value`.

Every layer is merged onto the structured schema, so an unknown key or a value of the wrong
type fails here, before any rank or engine starts, with the key, the value and the fix.
"""
from __future__ import annotations

import difflib
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from megarl.config.schema import ConfigError, RootConfig


def _known_keys(cls=RootConfig, prefix="") -> list[str]:
    out = []
    for f in fields(cls):
        t = f.default_factory if is_dataclass(getattr(f, "default_factory", None)) else None
        if t is not None:
            out += _known_keys(t, f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def _explain(err: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(err, "full_key", None) or getattr(err, "key", None) or "?"
    if isinstance(err, ConfigKeyError):
        near = difflib.get_close_matches(str(key), _known_keys(), n=3)
        hint = f"did you mean {', '.join(near)}?" if near else "see megarl/config/schema.py for the keys"
        return ConfigError(f"unknown config key '{key}' (from {source}): {hint}")
    if isinstance(err, ValidationError):
        first_line = str(err).splitlines()[0]
        if "is not a ListConfig" in first_line:   # a list setting given one plain value
            return ConfigError(f"{key} is a list (from {source}): write {key}=[a,b] on the command line, "
                               f"or a YAML list in a recipe")
        return ConfigError(f"{key}: {first_line} (from {source}); give a value of the type "
                           f"declared in megarl/config/schema.py")
    return ConfigError(f"{key}: {err} (from {source})")


def _yaml_problem(err: Exception) -> str:
    """A YAML parser error in a few words, with where it is (1-based line and column)."""
    mark = getattr(err, "problem_mark", None)
    what = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"{what} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else what


def _load_recipe(path: Path):
    """One recipe file as a mapping; a file that is not YAML, or not a mapping of sections,
    is named with the place to fix."""
    try:
        raw = OmegaConf.load(path)
    except yaml.YAMLError as err:
        raise ConfigError(f"recipe '{path}' is not valid YAML ({_yaml_problem(err)}): fix that line; "
                          f"a recipe is sections of key: value lines, e.g. recipes/tiny_cpu.yaml") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"recipe '{path}' cannot be read ({err}): pass a YAML text file") from None
    if not OmegaConf.is_dict(raw):
        raise ConfigError(f"recipe '{path}' holds a {type(raw).__name__.replace('Config', '').lower()}, not "
                          f"sections of settings (run:, model:, train:, ...): see recipes/tiny_cpu.yaml")
    return raw


def _sections_problem(layer, cls, prefix: str = "") -> str | None:
    """A layer giving a plain value where the schema has a section (`train: 5`,
    `train=3`): omegaconf's own message names neither the key nor the fix."""
    for f in fields(cls):
        sub = f.default_factory if is_dataclass(getattr(f, "default_factory", None)) else None
        if sub is None or not OmegaConf.is_dict(layer) or f.name not in layer:
            continue
        value = layer[f.name]
        if value is None:   # `train:` with every line under it commented out: nothing to change
            del layer[f.name]
            continue
        if not OmegaConf.is_dict(value):
            keys = ", ".join(f"{prefix}{f.name}.{k.name}" for k in fields(sub)[:3])
            return (f"{prefix}{f.name} is a section of settings ({keys}, ...), not the value {value!r}: "
                    f"give one of its keys, e.g. {prefix}{f.name}.{fields(sub)[0].name}=...")
        deeper = _sections_problem(value, sub, f"{prefix}{f.name}.")
        if deeper:
            return deeper
    return None


def _recipe_layers(path: Path, seen: tuple = ()) -> list[tuple[str, object]]:
    """Flatten a recipe and its `defaults:` chain, parents first."""
    if path.is_dir():
        raise ConfigError(f"recipe '{path}' is a folder: pass a YAML file in it, e.g. recipes/tiny_cpu.yaml")
    if not path.is_file():
        raise ConfigError(f"recipe '{path}' does not exist: pass a YAML file, e.g. recipes/tiny_cpu.yaml")
    if path.resolve() in seen:
        raise ConfigError(f"recipe '{path}' includes itself through `defaults:`")
    raw = _load_recipe(path)
    parents = raw.pop("defaults", []) if "defaults" in raw else []
    if isinstance(parents, str) or not OmegaConf.is_list(parents) and not isinstance(parents, list):
        parents = [parents]
    layers = []
    for parent in parents:
        layers += _recipe_layers(path.parent / str(parent), seen + (path.resolve(),))
    layers.append((str(path), raw))
    return layers


# keys a recipe may spell as in docs/design.md but that cannot be Python field names
ALIASES = {("rollout", "async"): "asynchronous"}


def _apply_aliases(layer) -> None:
    for (section, key), field in ALIASES.items():
        sub = layer.get(section) if OmegaConf.is_dict(layer) else None
        if OmegaConf.is_dict(sub) and key in sub:
            sub[field] = sub.pop(key)


def load_config(recipe: str | Path | None, overrides: Sequence[str] = ()) -> RootConfig:
    """Resolve a recipe + `key=value` overrides into a validated RootConfig."""
    cfg = OmegaConf.structured(RootConfig)
    layers = _recipe_layers(Path(recipe)) if recipe else []
    for item in overrides:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise ConfigError(f"override '{item}' is not key=value: write e.g. train.steps=10")
        try:
            OmegaConf.from_dotlist([item])
        except (yaml.YAMLError, OmegaConfBaseException) as err:
            what = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"override '{item}': its value is not valid YAML ({what}): "
                              f"quote it, or close its brackets, e.g. rollout.engine_urls=[http://host:8000]") from None
    if overrides:
        layers.append(("the command line", OmegaConf.from_dotlist(list(overrides))))
    for source, layer in layers:
        _apply_aliases(layer)
        problem = _sections_problem(layer, RootConfig)
        if problem:
            raise ConfigError(f"{problem} (from {source})")
        try:
            cfg = OmegaConf.merge(cfg, layer)
        except OmegaConfBaseException as err:
            raise _explain(err, source) from None
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise _explain(err, "the merged config") from None


def save_config(cfg: RootConfig, path: str | Path) -> None:
    """Write the fully resolved config (every default spelled out) next to the run's outputs."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), path)
