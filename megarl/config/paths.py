"""Checks of user-given paths that run before anything is written."""
from __future__ import annotations

import os

from megarl.config.schema import ConfigError


def check_writable(path: str, setting: str) -> None:
    """`path` is (or can be created as) a folder this process can write in."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ConfigError(f"{setting}={path!r}: {probe!r} is a file, not a folder: point {setting} at a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{setting}={path!r}: {probe!r} is not writable by this user: choose a folder "
                          f"you can write to")
