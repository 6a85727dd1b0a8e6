"""The sandbox's modes, forced for a test (tests/unit/test_sandbox*.py): every run in the test
gets the layers of its mode, or the test is skipped where this machine lacks them.

- "ns": namespaces + Landlock + seccomp + the audit hook (the full sandbox);
- "fallback": namespaces forced off (Landlock + seccomp + the audit hook);
- "ns-kernel", "fallback-kernel": the same without the audit hook, so the kernel layers alone
  meet each route (code that gets past the hook, as native code or ctypes would)."""
from __future__ import annotations

import dataclasses

import pytest

from megarl.envs import sandbox
from megarl.envs.sandbox import SandboxLayers, SandboxLimits

FAST = SandboxLimits(cpu_s=10, wall_s=20)   # generous: a loaded machine starts interpreters slowly
MODES = ["ns", "fallback"]
KERNEL_MODES = MODES + ["ns-kernel", "fallback-kernel"]


def force(monkeypatch, mode: str) -> SandboxLayers:
    """Make every run in this test get `mode`'s layers (skip where the machine lacks them)."""
    real = sandbox.available_layers()
    if real.missing():
        pytest.skip(f"this machine lacks a kernel layer the sandbox needs: {sandbox.refusal(real)}")
    if mode.startswith("ns") and not real.namespaces:
        pytest.skip("user namespaces do not work on this machine")
    layers = dataclasses.replace(real, namespaces=mode.startswith("ns"), hook=not mode.endswith("kernel"))
    monkeypatch.setattr(sandbox, "available_layers", lambda: layers)
    return layers
