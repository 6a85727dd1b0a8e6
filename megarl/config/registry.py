"""Registries: the named implementations behind one extension point each.

A registry belongs to the config layer (so `config/schema/` validates a setting against it
without importing what sits above config) and is filled by the module that holds the code:

    # megarl/ppo/losses.py
    from megarl.config.registry import KL_KINDS

    @KL_KINDS.register("k3")
    def _k3(diff): ...

`home` names the module whose import registers every built-in entry; the registry imports it
the first time anyone asks for names or an entry, so validating a recipe sees them all. Adding
an engine kind, a loss option, a KL kind, an aggregation or a verifier is one `register` call
next to its code (docs/architecture.md, "Extension points").
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Iterator

from megarl.config.errors import ConfigError


class Registry:
    """Names -> objects for one setting. Iterating, `in`, `names()` and `get()` see the
    built-in entries (home imported) and any registered since."""

    def __init__(self, key: str, home: str, what: str, doc: str = "docs/architecture.md"):
        self.key, self.home, self.what, self.doc = key, home, what, doc
        self._entries: dict[str, Any] = {}
        self._loaded = False

    def register(self, name: str, obj: Any = None) -> Callable:
        """`@REG.register("name")` above a function or class, or `REG.register("name", obj)`.
        A name registered twice with a different object is a bug: it raises."""
        def add(o):
            old = self._entries.get(name)
            if old is not None and old is not o:
                raise ValueError(f"{self.key}: {name!r} is registered twice ({old!r} and {o!r})")
            self._entries[name] = o
            return o
        return add(obj) if obj is not None else add

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True   # first: a home that asks for its own names does not recurse
            try:
                importlib.import_module(self.home)
            except BaseException:
                self._loaded = False   # a broken home raises again, never "unknown name" later
                raise

    def names(self) -> list[str]:
        self._load()
        return sorted(self._entries)

    def __contains__(self, name) -> bool:
        self._load()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def check(self, value, key: str | None = None) -> None:
        """ConfigError naming the setting, the value and the known names, if unknown."""
        if value not in self:
            raise ConfigError(f"{key or self.key}={value!r}: unknown {self.what}; use one of "
                              f"{', '.join(self.names())} (new ones: {self.doc})")

    def get(self, name: str, key: str | None = None) -> Any:
        self.check(name, key)
        return self._entries[name]


# One registry per extension point. The home module registers the built-in entries.
ENGINE_KINDS = Registry("rollout.engines.mode", "megarl.rollout.build", "engine kind")
VERIFIERS = Registry("reward.fn", "megarl.rewards", "verifier", doc="docs/data.md")
KL_KINDS = Registry("algo.kl_kind", "megarl.ppo.losses", "KL estimator")
LOSS_AGGS = Registry("algo.loss_agg", "megarl.ppo.aggregate", "loss aggregation")
ADVANTAGES = Registry("algo.name", "megarl.ppo.advantages", "algorithm (advantage estimator)")
IS_MODES = Registry("algo.is_mode", "megarl.ppo.correction", "importance-sampling correction")
IS_LEVELS = Registry("algo.is_level", "megarl.ppo.correction", "importance-sampling level")
ENVIRONMENTS = Registry("env.name", "megarl.envs.builtin", "environment", doc="docs/agents.md")
