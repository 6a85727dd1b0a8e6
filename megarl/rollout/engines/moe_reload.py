"""Engine side: MoE expert weights reloaded in place on vLLM's CPU backend keep their kernel
layout. Installed by `plugin.register` in every vLLM process.

Why: vLLM (0.32.0) runs the CPU experts' own `process_weights_after_loading` (zero-pad the
intermediate dim to the kernel's alignment, prepack into its grouped-gemm layout) only when a
layer's MoE kernel is first built (`UnquantizedFusedMoEMethod._setup_kernel`: "Setup moe kernel
only on the first call"). A weight update (the layerwise reload every transport goes through:
`initialize_layerwise_reload` ... `finalize_layerwise_reload`, or `reload_weights`) loads the
new experts into a fresh unpacked layer, skips the prepack, and copies the unpacked values into
the packed storage the kernel reads: same shape, other layout, so the experts compute garbage
(reloading the very same weights moved a tiny Qwen3-MoE's prompt logprobs by 6.3) while
attention and the router are right.

The fix: on a weight update, after vLLM's own `_setup_kernel`, run the CPU experts' pad and
prepack on the layer being loaded, so what is copied into the kernel's storage is in its layout
(same shapes as the first load, so the copy checks them). GPU experts are left to vLLM: their
update path keeps the layout they shuffle into.
"""
from __future__ import annotations

_MARK = "_megarl_cpu_moe_reload"


def _cpu_experts_class():
    """vLLM's CPU unquantized experts class (x86 / arm / power derive from it), or None where
    this vLLM has none (a GPU build without the CPU kernels)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return None
    return CPUUnquantizedExperts


def needs_repack(moe_kernel, cpu_class) -> bool:
    """Whether a layer's built MoE kernel runs experts that keep a prepacked copy of their
    weights (vLLM's CPU grouped-gemm experts)."""
    if moe_kernel is None or cpu_class is None:
        return False
    return isinstance(getattr(moe_kernel, "fused_experts", None), cpu_class)


def install() -> bool:
    """Wrap `UnquantizedFusedMoEMethod._setup_kernel` once per process. Returns whether the
    wrapper is in place (False where this vLLM has no such method or no CPU experts)."""
    try:
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:
        return False
    cpu_class = _cpu_experts_class()
    original = getattr(UnquantizedFusedMoEMethod, "_setup_kernel", None)
    if original is None or cpu_class is None:
        return False
    if getattr(original, _MARK, False):
        return True

    def _setup_kernel(self, layer, w13, w2):
        updating = getattr(self, "moe_kernel", None) is not None
        original(self, layer, w13, w2)
        if updating and needs_repack(self.moe_kernel, cpu_class):
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    setattr(_setup_kernel, _MARK, True)
    _setup_kernel.__wrapped__ = original
    UnquantizedFusedMoEMethod._setup_kernel = _setup_kernel
    return True
