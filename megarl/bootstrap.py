"""The one process set-up that must run before megatron is imported: `bootstrap()`.

megatron-core reads torch.cuda state when its modules are imported, and on a CPU-only machine
the CPU shim (megarl.distributed.cpu) must have replaced that state first; the jit hook
(megarl.distributed.megatron_jit, installed by `import megarl`) must see megatron.core.jit
being imported. So every entry point (the `megarl` CLI, each rank, the serve module, tools,
test probes, benches) calls `bootstrap()` before it imports anything that imports megatron;
after that, modules import each other at the top of their files. `bootstrap()` raises if
megatron was imported before it, and tests/unit/test_structure.py checks the same statically.
"""
from __future__ import annotations

import sys

_done = False
_on_cpu = False   # what the first call found: no GPU, so the shim is on


def megatron_loaded() -> bool:
    return any(m == "megatron" or m.startswith("megatron.") for m in sys.modules)


def bootstrap() -> bool:
    """Idempotent. Installs the jit hook and, without a GPU, the CPU shim. Returns whether the
    shim was applied (this process runs on CPU)."""
    global _done, _on_cpu
    if _done:
        return _on_cpu
    if megatron_loaded():
        raise RuntimeError("megatron was imported before megarl.bootstrap.bootstrap(): call bootstrap() "
                           "at the entry point before importing megatron or a megarl module that does")
    from megarl.distributed import cpu, megatron_jit
    megatron_jit.install()
    _on_cpu = cpu.apply_if_cpu()
    _done = True
    return _on_cpu

