"""The CPU shim's three patches for megatron-core's MoE layers (megarl/distributed/cpu.py).

Each test pins one gap: that megatron (0.16.1, no Transformer Engine, a CPU torch) still has it,
and that the shim closes it. When an upgrade closes a gap upstream, its test says the patch can
go. The MoE layers running end to end on CPU: tests/unit/test_moe_mapping.py (1 rank, both
dispatchers) and tests/dist/test_moe_layouts.py (EP=2)."""
import numpy as np
import pytest
import torch

from megarl.bootstrap import bootstrap

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shim runs on CPU only")


def test_router_gemm_name_is_bound_without_transformer_engine():
    """moe_utils binds te_general_gemm only when TE imports, yet the router's gating reads it:
    the shim binds None, which selects torch's matmul."""
    assert bootstrap()
    import megatron.core.transformer.moe.moe_utils as moe_utils
    assert not moe_utils.HAVE_TE
    assert moe_utils.te_general_gemm is None
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    out = moe_utils.router_gating_linear(x, w, None, torch.float32)
    torch.testing.assert_close(out, x @ w.t())


def test_cuda_stream_and_event_stand_ins():
    """The alltoall dispatcher makes a torch.cuda.Stream at build and synchronizes on the event
    it records there; CPU torch cannot make either."""
    bootstrap()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    stream.record_event().synchronize()
    torch.cuda.Event().synchronize()


def test_alltoall_split_sizes_become_numpy_on_cpu():
    """megatron turns the dispatcher's split sizes into numpy only for CUDA tensors, and gloo's
    all_to_all_single refuses tensors as split sizes: on CPU the shim returns numpy copies."""
    bootstrap()
    import megatron.core.transformer.moe.token_dispatcher as td
    splits = torch.tensor([3, 1])
    assert torch.is_tensor(td.maybe_move_tensor_to_cpu.original(splits, as_numpy=True))  # the gap
    out = td.maybe_move_tensor_to_cpu(splits, as_numpy=True)
    assert isinstance(out, np.ndarray) and out.tolist() == [3, 1]
    splits[0] = 9
    assert out.tolist() == [3, 1]          # a copy, as the CUDA path's device-to-host copy is
    assert td.maybe_move_tensor_to_cpu(splits) is splits   # tensors wanted as tensors stay so
