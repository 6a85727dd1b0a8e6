"""The environment protocol: what a multi-turn episode talks to between model turns.

An episode is one sample. It starts from the record's prompt (encoded as single-turn prompts
are); `reset(record)` may add a first observation. Then model turns (one engine request each,
ending on EOS / a stop token) alternate with `step(turn_text)`, whose observation is appended
to the token ids as context until `done`, `env.max_turns` or the token budget ends it. The
trainer sees one token sequence per episode with a loss mask: 1 on model tokens (trained, with
behaviour logprobs and versions), 0 on observation tokens (docs/agents.md).

An environment is one object per episode (`EnvSpec.factory()` makes it), so it may keep the
episode's state in attributes. Its methods are coroutines run on the environment loop
(`megarl.envs.runner.EnvRunner`, a thread of its own), never on the rollout loop, and each call
is bounded by `env.timeout_s`: CPU-heavy work belongs in a subprocess or `asyncio.to_thread`
(a coroutine that computes without awaiting blocks every other episode's environment).
An environment that raises or runs out of time ends its episode with reward 0, counted
(`env_errors`, `env_timeouts`); the run goes on.

Episodes must be replayable: a resumed run re-creates an environment by `reset(record)` then
`step` with each recorded model turn, and keeps the recorded observation tokens. An
environment whose answers depend on anything but the record, the turns and `seed` cannot be
resumed mid-episode exactly (the replay then warns).
"""
from __future__ import annotations

import abc
import inspect
from dataclasses import dataclass, field
from typing import Callable, Optional

from megarl.config.extension import ExtensionError, a
from megarl.config.registry import ENVIRONMENTS


@dataclass
class StepResult:
    """What the environment answers to one model turn."""
    observation: str = ""            # appended as context (mask 0) before the next model turn
    reward: float = 0.0              # added to the episode's reward
    done: bool = False               # the episode ends here (the observation is not appended)
    info: dict = field(default_factory=dict)   # free-form; counted keys go to metrics


class Environment(abc.ABC):
    """One episode's environment. `seed` is the episode's own (seeds.sample_seed of its group
    and index): use it for any randomness, so a replay gives the same answers."""

    def __init__(self, seed: int = 0, **options):
        self.seed = seed
        self.options = options

    async def reset(self, record: dict) -> Optional[str]:
        """Start the episode of `record` (a row of data.prompts). Returns an observation to
        append after the prompt before the first model turn, or None (the prompt says it all)."""
        return None

    @abc.abstractmethod
    async def step(self, turn: str) -> StepResult:
        """The model's turn (decoded without special tokens) -> the environment's answer."""

    async def close(self) -> None:  # noqa: B027 - optional hook: most environments hold nothing
        """Release what the episode holds (processes, folders). Called once, also after errors."""


@dataclass(frozen=True)
class EnvSpec:
    """A registered environment: how to make one per episode, and what it needs."""
    name: str
    factory: Callable[..., Environment]   # factory(seed=..., **env.options) -> Environment
    doc: str = ""


def register_env(name: str, doc: str = "") -> Callable:
    """`@register_env("name")` above an Environment subclass (or a factory function) makes it
    available as `env.name=name` in recipes."""
    def add(factory):
        ENVIRONMENTS.register(name, EnvSpec(name, factory, doc or (factory.__doc__ or "").strip()))
        return factory
    return add


def spec_from_import(obj, value: str) -> EnvSpec:
    """The entry of env.name=`value` (package.module:Class or path/to/file.py:Class) naming `obj`:
    an Environment subclass (its constructor takes seed= and env.options as keywords) or an
    EnvSpec. ExtensionError says what is wrong."""
    if isinstance(obj, EnvSpec):
        return obj
    if not (isinstance(obj, type) and issubclass(obj, Environment)):
        what = f"the class {obj.__name__}" if isinstance(obj, type) else a(obj)
        raise ExtensionError(f"is {what}, not a subclass of megarl.envs.base.Environment: name a class "
                             f"deriving from it (docs/agents.md)")
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(obj.__abstractmethods__))
        raise ExtensionError(f"does not define {missing} (abstract in Environment): add "
                             f"`async def {missing.split(',')[0]}(self, turn)`")
    return EnvSpec(value, obj, (obj.__doc__ or "").strip())


def env_spec(name: str) -> EnvSpec:
    """The environment `name` (registered, or an import path); an unknown name or a bad path
    raises ConfigError naming env.name."""
    return ENVIRONMENTS.get(name)
