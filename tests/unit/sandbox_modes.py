"""The sandbox's modes, forced for a test (tests/unit/test_sandbox*.py): every run in the test
gets the layers of its mode, or the test is skipped where this machine lacks them.

- "ns": namespaces + Landlock + seccomp + the audit hook (the full sandbox);
- "fallback": namespaces forced off (Landlock + seccomp + the audit hook);
- "ns-kernel", "fallback-kernel": the same without the audit hook, so the kernel layers alone
  meet each route (code that gets past the hook, as native code or ctypes would).

`bpf` runs the seccomp filter on one system call, as the kernel would (both ABIs, whatever this
machine is)."""
from __future__ import annotations

import dataclasses
import struct

import pytest

from megarl.envs import sandbox, sandbox_kernel
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
    if layers.missing():   # e.g. a child that keeps a capability holds without namespaces no more
        pytest.skip(f"mode {mode} lacks a guarantee here: {sandbox.refusal(layers)}")
    monkeypatch.setattr(sandbox, "available_layers", lambda: layers)
    return layers


def bpf(prog, arch: int, nr: int, arg0: int = 0, pid: int = 4242) -> int:
    """What the kernel would answer: the filter run on one seccomp_data."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, arg0 & (2**64 - 1), 0, 0, 0, 0, 0)
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = prog[pc]
        k = pid if k == sandbox_kernel.SELF else k
        if code == 0x20:
            acc, pc = struct.unpack_from("<I", data, k)[0], pc + 1
        elif code == 0x06:
            return k
        else:
            hit = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += 1 + (jt if hit else jf)
        assert 0 <= pc < len(prog), "a jump leaves the program"
