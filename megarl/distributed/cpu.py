"""The CPU shim: lets megatron-core 0.16 run on a CPU-only torch build over gloo.

Applied only when no GPU is present (`apply_if_cpu`). megatron-core hard-codes CUDA in a few
places; each patch below maps one of them onto the CPU. They reach into private internals, so
the CPU path pins megatron-core==0.16.1 (setup.py extra `cpu`). On GPU none of this runs.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_applied = False


class _NullStream:
    """Stand-in for a CUDA stream: megatron's DDP waits on events that do not exist on CPU."""

    def wait_event(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return None

    def synchronize(self):
        pass


def _is_cuda_device(d) -> bool:
    if isinstance(d, str):
        return d.startswith("cuda")
    if isinstance(d, torch.device):
        return d.type == "cuda"
    return isinstance(d, int) and not isinstance(d, bool)  # a bare CUDA ordinal


class _CudaToCpu(TorchFunctionMode):
    """Rewrites hard-coded `device="cuda"` (e.g. in megatron's schedules) to CPU, makes
    `Tensor.cuda()` a no-op, and has `Tensor.type()` report `torch.cuda.*` because megatron's
    optimizer and grad clipping assert on that string."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if name.startswith("torch.") and ".cuda." not in name:
                return name.replace("torch.", "torch.cuda.", 1)
            return name
        return func(*args, **kwargs)


def _patch_rng() -> None:
    # megatron's CudaRNGStatesTracker (model_parallel_cuda_manual_seed, tracker.fork) keeps
    # per-TP-rank RNG streams; on CPU they live in the CPU generator.
    import megatron.core.tensor_parallel.random as mrandom

    def get_state(device="cuda"):
        return torch.get_rng_state()

    torch.cuda.get_rng_state = get_state
    torch.cuda.random.get_rng_state = get_state
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    torch.cuda.random.manual_seed = torch.cuda.manual_seed
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)


def _patch_adam_step_on_load() -> None:
    # Without Apex/TE megatron falls back to torch Adam, which keeps a per-parameter "step".
    # The fully reshardable distributed-optimizer checkpoint stores step once (load_state_dict
    # restores it) and per-parameter only param/exp_avg/exp_avg_sq, so copying the loaded
    # tensors into the state must skip "step" instead of failing with KeyError.
    from megatron.core.optimizer import distrib_optimizer as dopt

    if dopt.HAVE_APEX_OR_TE:
        return
    original = dopt.DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if "step" in tensors:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            return original(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    dopt.DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def apply() -> None:
    """Install every patch once (idempotent). Call before megatron builds anything."""
    global _applied
    if _applied:
        return
    torch.cuda.current_device = lambda: _CPU          # megatron's buffers and p2p recv buffers
    torch.cuda.synchronize = lambda *a, **k: None      # p2p communication and parallel_state
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    torch.cuda.default_stream = lambda *a, **k: _NullStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    _patch_rng()
    _patch_adam_step_on_load()
    _CudaToCpu().__enter__()  # stays active for the life of the process
    _applied = True


def apply_if_cpu() -> bool:
    """Apply the shim when this process has no GPU; return whether it did."""
    if torch.cuda.is_available():
        return False
    apply()
    return True
