"""The checks every config section shares: one line naming the key, the value and the fix."""
from __future__ import annotations

from dataclasses import MISSING, fields

from megarl.config.errors import ConfigError


def require(ok: bool, key: str, value, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {fix}")


def one_of(key: str, value, allowed) -> None:
    require(value in allowed, key, value, f"must be one of {sorted(allowed)}")


def plain(value):
    """An omegaconf list / dict as a python one (other values unchanged), for comparing with a default."""
    if hasattr(value, "items"):
        return dict(value.items())
    return list(value) if not isinstance(value, (str, bytes)) and hasattr(value, "__iter__") else value


def changed(obj, names) -> list[str]:
    """The fields among `names` whose value is not the field's default (from the dataclass
    itself, so a default changed in one place is not left stale in a check)."""
    out = []
    for f in fields(obj):
        if f.name in names:
            default = f.default if f.default is not MISSING else f.default_factory()
            if plain(getattr(obj, f.name)) != default:
                out.append(f.name)
    return out
