"""User code named by an import path in a setting: `package.module:attr` (an importable module)
or `path/to/file.py:attr` (a file, relative to the working directory or absolute).

A registry (`config/registry.py`) resolves such a value when the config is validated, so a
missing module or attribute, or an object of the wrong kind, is a ConfigError before anything
starts. A file is loaded under a module name derived from its absolute path
(`file_module_name`), the same in every process: a function of it pickled by reference in one
process (a verifier sent to its worker) is found in another that loaded the same file
(`load_source(module_source(name))`).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
from types import ModuleType
from typing import Any

FORM = "package.module:attr or path/to/file.py:attr"
#: synthetic module name -> the file it was loaded from (this process)
_FILES: dict[str, str] = {}


class ExtensionError(ValueError):
    """What is wrong with one import path, without the setting (the registry adds it)."""


def a(obj: Any) -> str:
    """'a int' -> 'an int': the article and the type name of `obj`, for messages."""
    name = type(obj).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def is_import_path(value: Any) -> bool:
    return isinstance(value, str) and ":" in value


def _is_file(source: str) -> bool:
    return source.endswith(".py") or "/" in source or os.sep in source


def split(value: str) -> tuple[str, str]:
    """`source:attr` -> (source, attr); a malformed value raises ExtensionError."""
    source, _, attr = value.rpartition(":")
    if not source or not attr.isidentifier() or (not _is_file(source) and not all(
            part.isidentifier() for part in source.split("."))):
        raise ExtensionError(f"is not an import path: write {FORM}")
    return source, attr


def file_module_name(path: str) -> str:
    """The module name a file is loaded under: its stem and a hash of its absolute path."""
    path = os.path.abspath(path)
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    return f"megarl_ext_{stem}_{hashlib.sha1(path.encode()).hexdigest()[:10]}"


def _load_file(source: str) -> ModuleType:
    path = os.path.abspath(source)
    name = file_module_name(path)
    if name in sys.modules:
        return sys.modules[name]
    if not os.path.isfile(path):
        raise ExtensionError(f"there is no file {path}: give the path of a .py file (relative to the working "
                             f"directory {os.getcwd()}, or absolute), or an importable package.module")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module      # before running it: pickle and dataclasses look it up by name
    try:
        spec.loader.exec_module(module)
    except BaseException as err:
        del sys.modules[name]
        raise ExtensionError(f"loading {path} failed: {type(err).__name__}: {err}; fix the file") from err
    _FILES[name] = path
    return module


def _import(source: str) -> ModuleType:
    try:
        return importlib.import_module(source)
    except ModuleNotFoundError as err:
        if err.name and (source == err.name or source.startswith(err.name + ".")):
            raise ExtensionError(f"no module named {err.name!r} can be imported here: install it, put the folder "
                                 f"holding it on PYTHONPATH, or name its file (path/to/file.py:attr)") from err
        raise ExtensionError(f"importing {source} failed: {type(err).__name__}: {err}; install what it "
                             f"imports") from err
    except Exception as err:   # noqa: BLE001 - any error inside the user's module becomes one line
        raise ExtensionError(f"importing {source} failed: {type(err).__name__}: {err}; fix the module") from err


def load_source(source: str) -> ModuleType:
    """The module `source` names: a file path (loaded once per process) or a module name."""
    return _load_file(source) if _is_file(source) else _import(source)


def module_source(module_name: str) -> str:
    """What `load_source` takes to load module `module_name` in another process: the file's
    path for a module loaded from a file here, else the name itself."""
    return _FILES.get(module_name, module_name)


def resolve(value: str) -> Any:
    """The object `value` (`source:attr`) names; ExtensionError says what is missing."""
    source, attr = split(value)
    module = load_source(source)
    try:
        return getattr(module, attr)
    except AttributeError:
        public = sorted(n for n in vars(module) if not n.startswith("_"))[:12]
        raise ExtensionError(f"{source} has no attribute {attr!r} (it defines: {', '.join(public) or 'nothing'}); "
                             f"name one of them after the ':'") from None


def check_call(obj: Any, params: tuple[str, ...], kwargs: dict | None = None, call: str = "") -> None:
    """ExtensionError unless `obj` can be called as obj(*params, **kwargs) (positionally, then
    by keyword, as megarl does); `call` shows that call in the message (default: name(params))."""
    if not callable(obj):
        raise ExtensionError(f"is {a(obj)}, not a function: name a function taking "
                             f"({', '.join(params)})")
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):     # a builtin without a signature: trust it
        return
    try:
        sig.bind(*params, **(kwargs or {}))
    except TypeError as err:
        call = call or f"{getattr(obj, '__name__', 'fn')}({', '.join(params)})"
        raise ExtensionError(f"has the signature {sig}, but megarl calls it as {call} ({err})") from None
