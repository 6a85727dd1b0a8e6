"""Recipe loading: schema defaults <- recipe chain (`defaults:`) <- command-line `key=value`.

Every layer is checked against the schema's declared types (`_shape_problem`) and merged onto
the structured schema, so an unknown key or a value of the wrong type fails here, before any
rank or engine starts, with the key, the value and the fix. Each setting resolves to the value
of the last layer that sets it; only then, on the merged layers, are the settings a choice leaves
unused dropped where an earlier layer set them than the choice (`_drop_replaced`).
"""
from __future__ import annotations

import copy
import difflib
import functools
import typing
import warnings
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Iterator, Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError
from omegaconf.nodes import StringNode

from megarl.config.renames import ALIASES, MOVED
from megarl.config.schema import ConfigError, RootConfig
from megarl.config.schema.unused import CHOICES, unused_settings
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
    return ConfigError(f"{key}: {str(err).splitlines()[0]} (from {source})")


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


@functools.cache
def _declared(cls) -> dict:
    """`cls`'s fields -> their declared types (the schema's modules postpone their annotations)."""
    return typing.get_type_hints(cls)


_WORDS = {str: "text", int: "a whole number", float: "a number", bool: "true or false"}


def _plain_value(node):
    """A layer's node as the plain value it holds, for a message."""
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=False)
    return node._value()


def _value_problem(key: str, node, declared) -> str | None:
    """What is wrong with the kind of `node` (a layer's value) for a setting declared `declared`,
    in one line naming `key`; None when its kind fits (omegaconf converts the value and refuses
    what it cannot convert, `train.steps=abc`, naming the key itself)."""
    args = typing.get_args(declared)
    nullable = typing.get_origin(declared) is typing.Union and type(None) in args
    if nullable:
        declared = next(a for a in args if a is not type(None))
    origin, value = typing.get_origin(declared) or declared, _plain_value(node)
    word = _WORDS.get(declared, "a list" if origin is list else "a mapping" if origin is dict else str(declared))
    if declared is typing.Any:   # its section checks the shapes it takes (data.prompts)
        return f"{key} cannot be null: give a value, or leave it out for its default" if node._is_none() else None
    if node._is_none():
        return None if nullable else (f"{key} cannot be null: give {word}"
                                      f"{'' if key.endswith(']') else ', or leave it out for its default'}")
    if node._is_missing() or node._is_interpolation():
        return None
    if origin is list:
        if not isinstance(node, ListConfig):
            return (f"{key} is a list, not {value!r}: write {key}=[a,b] on the command line, "
                    f"or a YAML list in a recipe")
        item = (typing.get_args(declared) or (typing.Any,))[0]
        for i in range(len(node)):
            problem = None if item is typing.Any else _value_problem(f"{key}[{i}]", node._get_node(i), item)
            if problem:
                return problem
        return None
    if origin is dict:
        return None if isinstance(node, DictConfig) else (
            f"{key} is a mapping of names to values, not {value!r}: write {key}={{name: value}} on the "
            f"command line, or a YAML mapping in a recipe")
    if isinstance(node, (DictConfig, ListConfig)):
        kind = "mapping" if isinstance(node, DictConfig) else "list"
        return (f"{key} takes a single value ({word}), not the {kind} {value!r}: give one value "
                f"(megarl/config/schema/ declares its type)")
    if declared is bool and type(value) in (int, float):
        return f"{key} is true or false, not the number {value!r}: write {key}=true or {key}=false"
    return None


def _shape_problem(layer, cls, prefix: str = "") -> str | None:
    """The first value of `layer` whose kind the schema's declared type cannot take, in one line
    naming its setting: a plain value where the schema has a section (`train: 5`, `train=3`), a
    list or a mapping where it has one value (`algo.name=[]`), one value where it has a list or
    a mapping (`env.options=[]`), null where it has no null. Checked once, here, before anything
    reads a layer: omegaconf's own errors name neither the key nor the fix, or are TypeErrors."""
    hints = _declared(cls)
    for f in fields(cls):
        if not OmegaConf.is_dict(layer) or f.name not in layer:
            continue
        key, node = f"{prefix}{f.name}", layer._get_node(f.name)
        sub = f.default_factory if is_dataclass(getattr(f, "default_factory", None)) else None
        if sub is None:
            problem = _value_problem(key, node, hints[f.name])
        elif node._is_none():   # `train:` with every line under it commented out: nothing to change
            del layer[f.name]
            continue
        elif not isinstance(node, DictConfig):
            keys = ", ".join(f"{key}.{k.name}" for k in fields(sub)[:3])
            problem = (f"{key} is a section of settings ({keys}, ...), not the value {_plain_value(node)!r}: "
                       f"give one of its keys, e.g. {key}.{fields(sub)[0].name}=...")
        else:
            problem = _shape_problem(node, sub, f"{key}.")
        if problem:
            return problem
    return None


def _parent_path(recipe: Path, parent: str) -> Path:
    """A `defaults:` entry of `recipe`: read relative to the recipe's own folder (an absolute
    path as it is); a missing one is named with why and the path that would work."""
    path = recipe.parent / parent
    if path.is_file():
        return path
    shipped = Path(__file__).resolve().parents[2] / "recipes" / parent   # the repository's recipes/
    fix = (f"write its path from there (here: {shipped})" if shipped.is_file()
           else "write its path from there, or copy it beside the recipe")
    raise ConfigError(f"recipe '{recipe}': defaults: entry '{parent}' is not a file at {path} (a defaults: "
                      f"entry is read relative to the folder of the recipe that names it): {fix}")


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
        layers += _recipe_layers(_parent_path(path, str(parent)), seen + (path.resolve(),))
    layers.append((str(path), raw))
    return layers


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
            return         # a plain value where a section goes: _shape_problem names it
    if key in node:
        raise ConfigError(f"{old} and {dotted} are both set (from {source}): {old} is the old name of "
                          f"{dotted}; keep {dotted} only")
    node[key] = value


_MISSING = object()

# settings that answer one question two ways (micro-batches by rows or by tokens), each with
# the values that do not put it in use (unset; a budget of 0, rows, or -1, derived: rows when
# micro_batch_size is set). One in use leaves the others unused as a choice does
# (`_drop_replaced`): `recipe.yaml train.max_tokens_per_micro_batch=4096` works where the recipe
# sets train.micro_batch_size. One layer setting both is left to the schema, which refuses it.
ALTERNATIVES = ({"train.micro_batch_size": (None,), "train.max_tokens_per_micro_batch": (0, -1)},)
# the settings whose value may leave others unused
_CHOOSERS = frozenset(CHOICES) | {key for group in ALTERNATIVES for key in group}


def _set_by(layers, key: str, dropped: set[str]) -> int:
    """The index of the last of `layers` that sets `key`; -1 when none does, or it was dropped."""
    if key in dropped:
        return -1
    return max((i for i, layer in enumerate(layers) if OmegaConf.select(layer, key, default=_MISSING) is not _MISSING),
               default=-1)


def _leaves_unused(cfg) -> Iterator[tuple[str, set[str]]]:
    """(a setting, the settings its value in `cfg` leaves unused): each choice of schema/unused.py
    CHOICES, and each of ALTERNATIVES in use."""
    for choice, _, keys, _ in unused_settings(cfg):
        yield choice, keys
    for group in ALTERNATIVES:
        for key, unused in group.items():
            if OmegaConf.select(cfg, key) not in unused:
                yield key, set(group) - {key}


def _drop_replaced(cfg, layers, defaults) -> None:
    """Each setting of `cfg` (the merged `layers`) holds the last layer's value that set it, except
    one a choice's merged value leaves unused that an earlier layer set than the choice: that one
    goes back to its default, as a later layer replaces a key (the recipe's train.critic_lr under
    the command line's `algo.name=grpo`). The layers in between do not matter: a parent's
    algo.kl_mode holds when a child sets algo.kl_coef=0 and the command line algo.kl_coef=0.05.
    One layer setting both is left to the schema, which refuses it. A choice dropped may have
    been what left others unused: choices go first, and the rest is decided again without them."""
    dropped: set[str] = set()
    while True:
        drops = {key for choice, keys in _leaves_unused(cfg) for key in keys
                 if -1 < _set_by(layers, key, dropped) < _set_by(layers, choice, dropped)}
        first = drops & _CHOOSERS
        for key in first or drops:
            OmegaConf.update(cfg, key, copy.deepcopy(OmegaConf.select(defaults, key)))
            dropped.add(key)
        if not first:
            return


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


@functools.cache
def _schema() -> DictConfig:
    """The structured schema with its defaults (built once: only read, or copied)."""
    return OmegaConf.structured(RootConfig)


def load_config(recipe: str | Path | None, overrides: Sequence[str] = ()) -> RootConfig:
    """Resolve a recipe + `key=value` overrides into a validated RootConfig."""
    defaults = _schema()
    cfg = copy.deepcopy(defaults)
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
        problem = _shape_problem(layer, RootConfig)
        if problem:
            raise ConfigError(f"{problem} (from {source})")
        _switch_words(cfg, layer)
        try:
            cfg.merge_with(layer)   # in place: OmegaConf.merge copies the whole config per layer
        except OmegaConfBaseException as err:
            raise _explain(err, source) from None
    _drop_replaced(cfg, [layer for _, layer in layers], defaults)
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
