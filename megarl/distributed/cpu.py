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


class _NullEvent:
    """Stand-in for a CUDA event: on CPU every operation has finished when it returns."""

    def __init__(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def wait(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def query(self) -> bool:
        return True


class _NullStream:
    """Stand-in for a CUDA stream: megatron's DDP waits on events that do not exist on CPU, and
    its MoE alltoall dispatcher makes a side stream (`torch.cuda.Stream()`) for its
    device-to-host copies and synchronizes on the event it records there."""

    def __init__(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _NullEvent()

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


def _patch_moe() -> None:
    # megatron-core 0.16.1's MoE layers without Transformer Engine on a CPU build:
    # 1. moe_utils binds te_general_gemm only inside its `import transformer_engine` block, yet
    #    the router's gating reads the name on every call (NameError): None selects torch's matmul.
    # 2. the alltoall dispatcher makes a torch.cuda.Stream at build (see _NullStream).
    # 3. the alltoall dispatcher turns its split sizes into numpy only for CUDA tensors
    #    (maybe_move_tensor_to_cpu(as_numpy=True) returns CPU tensors as they are), and gloo's
    #    all_to_all_single refuses tensors as split sizes: here they become numpy too.
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    torch.cuda.Stream = _NullStream       # classes: megatron annotates `torch.cuda.Stream | None`
    torch.cuda.Event = _NullEvent
    original = token_dispatcher.maybe_move_tensor_to_cpu

    def move_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.detach().clone().numpy()   # a copy, as the CUDA path's DtoH is
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    move_to_cpu.original = original
    token_dispatcher.maybe_move_tensor_to_cpu = move_to_cpu


def _patch_uneven_sequence_collectives() -> None:
    """megatron's gather / reduce-scatter along the sequence with per-rank split sizes (the
    alltoall MoE dispatcher at expert TP > 1: each TP rank's tokens routed to this rank's
    experts) call all_gather / reduce_scatter with tensors of unequal sizes, which NCCL takes
    and gloo refuses ("invalid tensor size"). On gloo each part is padded to the largest, the
    equal-size collective runs, and the padding is cut away: the same values."""
    import megatron.core.tensor_parallel.mappings as mappings

    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def padded(t: torch.Tensor, rows: int) -> torch.Tensor:
        return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))]) if rows > t.shape[0] else t

    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        rows = max(output_split_sizes)
        out = gather(padded(input_, rows), group)
        return torch.cat([out[r * rows:r * rows + n] for r, n in enumerate(output_split_sizes)])

    def scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        rows = max(input_split_sizes)
        parts = torch.split(input_, input_split_sizes, dim=0)
        out = scatter(torch.cat([padded(p, rows) for p in parts]), group)
        return out[:input_split_sizes[group.rank()]]

    gather_uneven.original, scatter_uneven.original = gather, scatter
    mappings._gather_along_first_dim = gather_uneven
    mappings._reduce_scatter_along_first_dim = scatter_uneven


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
    _patch_moe()
    _patch_uneven_sequence_collectives()
    _CudaToCpu().__enter__()  # stays active for the life of the process
    _applied = True


def apply_if_cpu() -> bool:
    """Apply the shim when this process has no GPU; return whether it did."""
    if torch.cuda.is_available():
        return False
    apply()
    return True
