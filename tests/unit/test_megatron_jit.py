"""megatron's fused kernels are compiled on first use, not wrapped in torch.compile at import
(megarl/distributed/megatron_jit.py)."""
import subprocess
import sys
import types

import torch
from conftest import ROOT

from megarl.distributed import megatron_jit


def test_importing_megatron_through_megarl_leaves_the_compiler_unloaded():
    code = ("import sys, megarl.models.builders, megatron.core.jit as j, megatron.core.fusions.fused_bias_swiglu as f\n"
            "from megarl.distributed.megatron_jit import lazy_compile\n"
            "assert j.jit_fuser is lazy_compile, j.jit_fuser\n"
            "assert f.bias_swiglu.lazy_compile_of is not None\n"
            "print('dynamo' if 'torch._dynamo' in sys.modules else 'no dynamo')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "no dynamo", out.stdout


def test_lazy_compile_compiles_once_on_the_first_call(monkeypatch):
    made = []

    def fake_compile(fn):
        made.append(fn)
        return lambda *a, **k: fn(*a, **k) + 1000      # tells the compiled path apart

    monkeypatch.setattr(torch, "compile", fake_compile)

    def fused(x, y=1):
        return x * 2 + y

    lazy = megatron_jit.lazy_compile(fused)
    assert made == [] and lazy.__name__ == "fused"
    assert lazy(3, y=2) == 1008 and made == [fused]
    assert lazy(4) == 1009 and made == [fused]         # compiled once


def test_only_a_torch_compile_fuser_is_replaced():
    compiled = types.SimpleNamespace(jit_fuser=torch.compile)
    megatron_jit.make_lazy(compiled)
    assert compiled.jit_fuser is megatron_jit.lazy_compile

    def noop(fn):
        return fn
    for other in (noop, torch.jit.script):           # disabled, or torch < 2.2
        module = types.SimpleNamespace(jit_fuser=other)
        megatron_jit.make_lazy(module)
        assert module.jit_fuser is other
