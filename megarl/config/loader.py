"""Recipe loading: schema defaults <- recipe chain (`defaults:`) <- command-line `key=value`.

Every layer is merged onto the structured schema, so an unknown key or a value of the wrong
type fails here, before any rank or engine starts, with the key, the value and the fix.
"""
from __future__ import annotations

import difflib
import warnings
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Sequence

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError
from omegaconf.nodes import StringNode

from megarl.config.schema import ConfigError, RootConfig
from megarl.config.schema.unused import CHOICES, unused_under
from megarl.config.secrets import redacted, resolve


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
        hint = f"did you mean {', '.join(near)}?" if near else "see megarl/config/schema/ for the keys"
        return ConfigError(f"unknown config key '{key}' (from {source}): {hint}")
    if isinstance(err, ValidationError):
        first_line = str(err).splitlines()[0]
        if "is not a ListConfig" in first_line:   # a list setting given one plain value
            return ConfigError(f"{key} is a list (from {source}): write {key}=[a,b] on the command line, "
                               f"or a YAML list in a recipe")
        return ConfigError(f"{key}: {first_line} (from {source}); give a value of the type "
                           f"declared in megarl/config/schema/")
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
ALIASES = {"rollout.partial.async": "rollout.partial.asynchronous"}

# rollout's flat keys from before they were grouped into sampling / engines / partial: still
# accepted in recipes and on the command line, each with one warning naming its new key
MOVED = {
    # first: the old count has the name of the new section, which the moves below fill
    "rollout.engines": "rollout.engines.count",
    **{f"rollout.{k}": f"rollout.sampling.{k}" for k in ("n", "max_new_tokens", "temperature", "top_p")},
    **{f"rollout.{k}": f"rollout.engines.{k}" for k in ("max_model_len", "api_key", "kv_cache_mb",
                                                        "gpu_memory_utilization", "enforce_eager")},
    **{f"rollout.engine_{k}": f"rollout.engines.{k}" for k in ("tp", "mode", "urls", "timeout_s",
                                                               "start_timeout_s", "failures_max", "restart")},
    **{f"rollout.{k}": f"rollout.partial.{k}" for k in ("concurrency", "max_staleness", "stale_policy",
                                                        "asynchronous")},
    "rollout.async": "rollout.partial.asynchronous",
}
_warned: set[str] = set()   # old keys already warned about in this process


def _pop(layer, dotted: str):
    """`dotted`'s value in `layer`, removed from it; `_MISSING` when the layer does not set it
    (or, for rollout.engines, sets the section rather than the old count)."""
    *path, key = dotted.split(".")
    node = layer
    for part in path:
        node = node.get(part) if OmegaConf.is_dict(node) else None
    if not OmegaConf.is_dict(node) or key not in node:
        return _MISSING
    if dotted == "rollout.engines" and (node[key] is None or OmegaConf.is_dict(node[key])):
        return _MISSING    # the new section of that name, not the old count
    return node.pop(key)


def _put(layer, dotted: str, value, old: str, source: str) -> None:
    *path, key = dotted.split(".")
    node = layer
    for part in path:
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
        if not OmegaConf.is_dict(node):
            return         # a plain value where a section goes: _sections_problem names it
    if key in node:
        raise ConfigError(f"{old} and {dotted} are both set (from {source}): {old} is the old name of "
                          f"{dotted}; keep {dotted} only")
    node[key] = value


_MISSING = object()

# settings that answer one question two ways (micro-batches by rows or by tokens), each with
# the value that leaves it unused (None: no value does). A layer that puts one in use (the
# command line over the recipe, a recipe over its `defaults:`) drops what earlier layers set
# for the others, as it would replace the same key: `recipe.yaml
# train.max_tokens_per_micro_batch=4096` works where the recipe sets train.micro_batch_size.
# One layer setting both is left to the schema, which refuses it.
ALTERNATIVES = ({"train.micro_batch_size": None, "train.max_tokens_per_micro_batch": 0},)


def _reset_unless_given(cfg, layer, defaults, keys) -> None:
    """`keys` the layer does not set go back to their defaults in `cfg` (what earlier layers set
    is dropped, as a later layer replaces a key it sets itself)."""
    for key in keys:
        if OmegaConf.select(layer, key, default=_MISSING) is _MISSING:
            OmegaConf.update(cfg, key, OmegaConf.select(defaults, key))


def _drop_alternatives(cfg, layer, defaults) -> None:
    for group in ALTERNATIVES:
        if any(OmegaConf.select(layer, k, default=_MISSING) not in (_MISSING, unused) for k, unused in group.items()):
            _reset_unless_given(cfg, layer, defaults, group)


def _drop_unused(cfg, layer, defaults) -> None:
    """A layer that makes a choice (schema/unused.py CHOICES: `algo.name=grpo` on the command line)
    drops what earlier layers set for the settings that choice leaves unused (the recipe's
    train.critic_lr), as it would replace the same key; one layer setting both is refused."""
    for choice in CHOICES:
        value = OmegaConf.select(layer, choice, default=_MISSING)
        if value is not _MISSING:
            _reset_unless_given(cfg, layer, defaults, unused_under(choice, value))


def _apply_aliases(layer, source: str) -> None:
    """Moved keys to their new place (warning once per old key), then spellings to fields."""
    for old, new in MOVED.items():
        value = _pop(layer, old)
        if value is _MISSING:
            continue
        if old not in _warned:
            _warned.add(old)
            warnings.warn(f"{old} is now {new} (from {source}): the old key still works, but write "
                          f"{new}", FutureWarning)
        _put(layer, new, value, old, source)
    for spelling, name in ALIASES.items():
        value = _pop(layer, spelling)
        if value is not _MISSING:
            _put(layer, name, value, spelling, source)


def _switch_words(schema, layer) -> None:
    """YAML 1.1 reads off / on (and no / yes) as booleans, in recipes and on the command line
    alike: a text setting whose values are words (algo.routing_replay: off | r2 | r3) got them as
    'False' and refused its own documented value. False in a text setting is the word off again."""
    for key in list(layer.keys()):
        if key not in schema or OmegaConf.is_missing(layer, key):
            continue
        node, value = schema._get_node(key), layer._get_node(key)
        if isinstance(value, DictConfig) and isinstance(node, DictConfig):
            _switch_words(node, value)
        elif isinstance(node, StringNode) and value._value() is False:
            layer[key] = "off"   # (no text setting has "on" among its values: True stays refused)


def load_config(recipe: str | Path | None, overrides: Sequence[str] = ()) -> RootConfig:
    """Resolve a recipe + `key=value` overrides into a validated RootConfig."""
    cfg, defaults = OmegaConf.structured(RootConfig), OmegaConf.structured(RootConfig)
    layers = _recipe_layers(Path(recipe)) if recipe else []
    for item in overrides:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise ConfigError(f"override '{item}' is not key=value: write e.g. train.steps=10")
        try:
            OmegaConf.from_dotlist([item])
        except (yaml.YAMLError, OmegaConfBaseException) as err:
            what = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"override '{item}': its value is not valid YAML ({what}): "
                              f"quote it, or close its brackets, e.g. "
                              f"rollout.engines.urls=[http://host:8000]") from None
    if overrides:
        layers.append(("the command line", OmegaConf.from_dotlist(list(overrides))))
    for source, layer in layers:
        _apply_aliases(layer, source)
        problem = _sections_problem(layer, RootConfig)
        if problem:
            raise ConfigError(f"{problem} (from {source})")
        _switch_words(cfg, layer)
        _drop_alternatives(cfg, layer, defaults)
        _drop_unused(cfg, layer, defaults)
        try:
            cfg = OmegaConf.merge(cfg, layer)
        except OmegaConfBaseException as err:
            raise _explain(err, source) from None
    try:
        out = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise _explain(err, "the merged config") from None
    return resolve(out)      # keys named by file read (config/secrets.py)


def save_config(cfg: RootConfig, path: str | Path) -> None:
    """Write the fully resolved config (every default spelled out, secrets redacted) next to the
    run's outputs."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(redacted(cfg), path)
