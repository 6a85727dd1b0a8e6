"""Every key of the schema, sections included, given a value of each kind (a list, a mapping,
null, a whole number, a number, text, a boolean), on the command line and in a recipe: the load succeeds, or it
raises ConfigError in one line; a value of a kind the setting's declared type cannot take is
refused in one line naming the setting's dotted path (issue 45, finding 9: `algo.name=[]` raised
a TypeError from schema/unused.py, `env.options=[]` one from omegaconf)."""
import re
import typing
from dataclasses import fields, is_dataclass

import pytest
import yaml

from megarl.config import ConfigError, load_config
from megarl.config.renames import MOVED
from megarl.config.schema import RootConfig

# each kind of value, as the command line writes it and as a recipe holds it
KINDS = {"list": ("[]", []), "mapping": ("{x: 1}", {"x": 1}), "null": ("null", None), "integer": ("3", 3),
         "number": ("2.5", 2.5), "text": ("abc", "abc"), "bool": ("true", True)}


def _keys(cls=RootConfig, prefix: str = ""):
    """(dotted key, declared type: a dataclass for a section) for every key of the schema."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        sub = f.default_factory if is_dataclass(getattr(f, "default_factory", None)) else None
        yield f"{prefix}{f.name}", sub or hints[f.name]
        if sub is not None:
            yield from _keys(sub, f"{prefix}{f.name}.")


KEYS = dict(_keys())


def _fits(declared, kind: str) -> bool:
    """Whether a value of `kind` is one `declared` takes (omegaconf converts a number or a
    boolean to text, as YAML reads `name: 2024`)."""
    if is_dataclass(declared):
        return kind == "null"            # a section with nothing under it changes nothing
    if declared is typing.Any:           # several shapes, checked by its section (data.prompts)
        return kind in ("list", "mapping", "text")
    args = typing.get_args(declared)
    if typing.get_origin(declared) is typing.Union and type(None) in args:
        if kind == "null":
            return True
        declared = next(a for a in args if a is not type(None))
    origin = typing.get_origin(declared) or declared
    return {"list": origin is list, "mapping": origin is dict, "null": False,
            "integer": declared in (int, float, str), "number": declared in (float, str), "text": declared is str,
            "bool": declared in (bool, str)}[kind]


def _takes(key: str, kind: str) -> bool:
    """Whether `key` takes a value of `kind`: its own type's, or, for an old flat key that is now
    a section (rollout.engines, config/renames.py MOVED), its new key's."""
    return _fits(KEYS[key], kind) or key in MOVED and _fits(KEYS[MOVED[key]], kind)


def test_every_key_and_kind_is_covered():
    assert len(KEYS) > 150
    assert {"algo.name", "env.options", "rollout.engines", "model.arch.moe_dense_layers"} <= set(KEYS)
    assert all(isinstance(_fits(declared, kind), bool) for declared in KEYS.values() for kind in KINDS)


def _problem(key: str, kind: str, recipe, overrides=()) -> str | None:
    """What is wrong with how loading `recipe` with `overrides` (`key` given a value of `kind`)
    ends; None if nothing."""
    try:
        load_config(recipe, overrides)
    except ConfigError as err:
        line = str(err)
        if "\n" in line:
            return f"{key}={kind}: more than one line: {line!r}"
        if not _takes(key, kind) and not re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", line):
            return f"{key}={kind}: {line!r} does not name {key}"
        return None
    except Exception as err:   # noqa: BLE001 - the point: any other exception is the failure
        return f"{key}={kind}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None if _takes(key, kind) else f"{key} took a {kind}"


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_value_of_each_kind_on_the_command_line(kind):
    problems = [_problem(key, kind, None, [f"{key}={KINDS[kind][0]}"]) for key in KEYS]
    assert not [p for p in problems if p], "\n".join(p for p in problems if p)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_value_of_each_kind_in_a_recipe(tmp_path, kind):
    problems = []
    for i, key in enumerate(KEYS):
        recipe = tmp_path / f"{i}.yaml"
        recipe.write_text(yaml.safe_dump(_nested(key, KINDS[kind][1])))
        problems.append(_problem(key, kind, recipe))
    assert not [p for p in problems if p], "\n".join(p for p in problems if p)


def _nested(key: str, value) -> dict:
    """{"a": {"b": value}} for key a.b: the recipe's form of the setting."""
    out: dict = {}
    *path, name = key.split(".")
    node = out
    for part in path:
        node = node.setdefault(part, {})
    node[name] = value
    return out


@pytest.mark.parametrize("override,named", [("algo.name=[]", "algo.name"), ("algo.is_mode=[]", "algo.is_mode"),
                                            ("env.options=[]", "env.options"),
                                            ("eval.datasets=[[1]]", r"eval\.datasets\[0\]"),
                                            ("metrics.wandb.tags=[{a: 1}]", r"metrics\.wandb\.tags\[0\]")])
def test_the_issues_values_are_one_line_naming_the_setting(override, named):
    with pytest.raises(ConfigError, match=rf"^{named} ") as err:
        load_config("recipes/tiny_cpu.yaml", [override])
    assert "\n" not in str(err.value)
