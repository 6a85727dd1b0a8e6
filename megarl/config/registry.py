"""Registries: the named implementations behind one extension point each.

A registry belongs to the config layer (so `config/schema/` validates a setting against it
without importing what sits above config) and is filled by the module that holds the code:

    # megarl/ppo/losses.py
    from megarl.config.registry import KL_KINDS

    @KL_KINDS.register("k3")
    def _k3(diff): ...

`home` names the module whose import registers every built-in entry; the registry imports it
the first time anyone asks for names or an entry, so validating a recipe sees them all. Adding
an engine kind, a loss option, a policy loss, a KL kind, an aggregation or a verifier is one `register` call
next to its code (docs/architecture.md, "Extension points").

A setting may also name code outside megarl by import path, `package.module:attr` or
`path/to/file.py:attr` (`config/extension.py`): `check` loads it and checks it is an entry of the
registry's kind (`takes`: a function called with those arguments; `kind`: an instance of that
class; `adapt`: a function of the home's side that turns the object into an entry or raises
ExtensionError), so a bad path is a ConfigError naming the setting before anything starts. The
entry is then kept under the whole value, where `get` finds it; `names()` lists built-ins only.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Iterator

from megarl.config import extension
from megarl.config.errors import ConfigError


class Registry:
    """Names -> objects for one setting. Iterating, `in`, `names()` and `get()` see the
    built-in entries (home imported) and any registered since; `in` and `get()` also see the
    import paths `check` resolved."""

    def __init__(self, key: str, home: str, what: str, doc: str = "docs/architecture.md", *,
                 takes: tuple[str, ...] = (), kind: str = "", adapt: str = ""):
        self.key, self.home, self.what, self.doc = key, home, what, doc
        # what an entry named by import path must be (one of the three; see the module docstring);
        # kind and adapt are import paths themselves: they live above config
        self.takes, self.kind, self.adapt = takes, kind, adapt
        self._entries: dict[str, Any] = {}
        self._imported: dict[str, Any] = {}   # import path -> its entry, resolved by check
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
        return name in self._entries or name in self._imported

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def check(self, value, key: str | None = None) -> None:
        """ConfigError naming the setting, the value and the fix, if `value` is neither a
        registered name nor an import path to an entry of this registry's kind."""
        if value in self:
            return
        imports = bool(self.takes or self.kind or self.adapt)
        if imports and extension.is_import_path(value):
            try:
                self._imported[value] = self._from_import(value)
            except extension.ExtensionError as err:
                raise ConfigError(f"{key or self.key}={value!r}: {err}") from err
            return
        raise ConfigError(f"{key or self.key}={value!r}: unknown {self.what}; use one of "
                          f"{', '.join(self.names())}{f', or your own as {extension.FORM}' if imports else ''} "
                          f"(see {self.doc})")

    def _from_import(self, value: str) -> Any:
        obj = extension.resolve(value)
        if self.adapt:
            return extension.resolve(self.adapt)(obj, value)
        if self.kind:
            cls = extension.resolve(self.kind)
            if not isinstance(obj, cls):
                raise extension.ExtensionError(f"is {extension.a(obj)}, not a {cls.__module__}.{cls.__name__}: "
                                               f"name an instance of it")
            return obj
        extension.check_call(obj, self.takes)
        return obj

    def get(self, name: str, key: str | None = None) -> Any:
        self.check(name, key)
        return self._entries[name] if name in self._entries else self._imported[name]


# One registry per extension point. The home module registers the built-in entries; the
# keywords say what an entry named by import path must be.
# engine kinds: built-in only (the schema checks rollout.engines.mode and the weight backend
# against the kinds it knows)
ENGINE_KINDS = Registry("rollout.engines.mode", "megarl.rollout.engines.build", "engine kind")
VERIFIERS = Registry("reward.fn", "megarl.rewards", "verifier", doc="docs/data.md",
                     adapt="megarl.rewards.entry:from_import")
KL_KINDS = Registry("algo.kl_kind", "megarl.ppo.losses", "KL estimator", takes=("diff",))
LOSS_AGGS = Registry("algo.loss_agg", "megarl.ppo.aggregate", "loss aggregation",
                     kind="megarl.ppo.aggregate:Aggregation")
ADVANTAGES = Registry("algo.name", "megarl.ppo.advantages", "algorithm (advantage estimator)",
                      kind="megarl.ppo.advantages:Estimator")
POLICY_LOSSES = Registry("algo.policy_loss", "megarl.ppo.losses", "policy loss", doc="docs/algorithms.md",
                         takes=("logp", "old_logp", "advantages", "mask", "clip_low", "clip_high", "dual_clip",
                                "is_weights"))
IS_MODES = Registry("algo.is_mode", "megarl.ppo.correction", "importance-sampling correction",
                    takes=("raw", "cap", "low", "high"))
IS_LEVELS = Registry("algo.is_level", "megarl.ppo.correction", "importance-sampling level",
                     takes=("log_w", "mask"))
ENVIRONMENTS = Registry("env.name", "megarl.envs.builtin", "environment", doc="docs/agents.md",
                        adapt="megarl.envs.base:spec_from_import")
GROUP_FILTERS = Registry("rollout.group_filter", "megarl.rollout.controller.group_filter", "group filter",
                         doc="docs/partial_rollout.md", takes=("samples",))
