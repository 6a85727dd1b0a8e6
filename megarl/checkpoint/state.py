"""What a checkpoint's driver.pt holds besides its step: the state of every registered component.

Each component (the data sampler, the global RNGs, the driver's rollout with its carry) is
registered once under a name with an object that has `state_dict()` and
`load_state_dict(state)`; a save (megarl/checkpoint/manager.py) writes each one's state under
its name, a resume hands each one its own. The names are the keys of driver.pt, so a
component registered under an existing name reads the checkpoints written before it.
Light: no megatron here (unit tests use it without the CPU shim).
"""
from __future__ import annotations

import random
from typing import Any, Protocol

import torch


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


#: driver.pt keys the checkpoint itself writes (manager.save): not component names
RESERVED = ("step", "version")


class StateRegistry:
    """Components by name, walked in registration order (a later one may overwrite what an
    earlier one loaded: the rollout restores the sampler's cursor of its own snapshot)."""

    def __init__(self):
        self._items: dict[str, tuple[Stateful, bool]] = {}

    def register(self, name: str, component: Stateful, optional: bool = False) -> None:
        """`optional`: checkpoints written before this component existed lack it; it then
        keeps its fresh state."""
        if name in self._items or name in RESERVED:
            raise ValueError(f"checkpoint state {name!r} is registered twice (or is one of {RESERVED})")
        self._items[name] = (component, optional)

    def names(self) -> list[str]:
        return list(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def state_dict(self) -> dict:
        return {name: c.state_dict() for name, (c, _) in self._items.items()}

    def load_state_dict(self, state: dict) -> None:
        for name, (c, optional) in self._items.items():
            if optional and name not in state:
                continue
            c.load_state_dict(state[name])


class GlobalRNG:
    """The process-wide torch and Python RNGs as one component."""

    def state_dict(self) -> dict:
        return rng_state()

    def load_state_dict(self, state: dict) -> None:
        set_rng_state(state)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
