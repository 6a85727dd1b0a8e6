"""megatron-core's fused kernels, compiled on first use instead of wrapped at import.

megatron-core decorates its fusable functions (bias-GeLU, bias-SwiGLU, bias-dropout-add, ...)
with `megatron.core.jit.jit_fuser`, which is `torch.compile` on torch >= 2.2. Calling
`torch.compile` imports torch's whole compiler stack (dynamo, inductor, sympy): about 3 s of
CPU in every process that imports megatron, whether or not a fused kernel ever runs (on CPU
the fusions are off, see `megarl/models/transformer_config.py`). With thousands of ranks, and a test suite
that starts a few hundred processes, that is time spent for nothing.

`install()` (called from `megarl/__init__.py`) adds an import hook for `megatron.core.jit`: once
that module has run, its `jit_fuser` is replaced by `lazy_compile`, which calls the same
`torch.compile` on a function's first call. Same kernels, same options, compiled at the same
moment (torch.compile itself only compiles on the first call); only the import moves.
If megatron's `jit_fuser` is anything else (torch.jit.script on old torch, or disabled), it is
left as it is.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

TARGET = "megatron.core.jit"


def lazy_compile(fn):
    """`torch.compile(fn)`, made on the first call rather than now."""
    compiled = None

    @functools.wraps(fn)
    def compile_on_first_call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            import torch
            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    compile_on_first_call.lazy_compile_of = fn
    return compile_on_first_call


def make_lazy(module) -> None:
    import torch
    if getattr(module, "jit_fuser", None) is torch.compile:
        module.jit_fuser = lazy_compile


class _Loader(importlib.abc.Loader):
    """Runs megatron.core.jit with its own loader, then makes its jit_fuser lazy."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        make_lazy(module)

    def __getattr__(self, name):          # get_source, get_filename ...: the real loader's
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Idempotent. If megatron.core.jit was imported before megarl, the functions decorated
    so far keep their torch.compile wrapper; later ones get the lazy one."""
    if TARGET in sys.modules:
        make_lazy(sys.modules[TARGET])
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
