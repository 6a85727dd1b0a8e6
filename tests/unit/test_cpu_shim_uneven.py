"""The CPU shim's patch for megatron's uneven sequence gathers (megarl/distributed/cpu.py
`_patch_uneven_sequence_collectives`): the alltoall MoE dispatcher at expert TP > 1 gathers and
reduce-scatters each TP rank's tokens with per-rank split sizes, which gloo refuses. Two gloo
ranks: megatron's own function still fails there (when an upgrade fixes it, the patch can go),
the patched one gathers, and its backward reduce-scatters, the exact values. End to end:
tests/dist/test_moe_layouts.py (TP=2 x EP=2)."""
import json

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shim runs on CPU only")
SIZES = [3, 5]   # rank 0 holds 3 rows, rank 1 holds 5


def _rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from megarl.bootstrap import bootstrap
    bootstrap()   # the CPU shim included
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    import megatron.core.tensor_parallel.mappings as mappings
    from megatron.core.parallel_state import get_tensor_model_parallel_group, initialize_model_parallel

    initialize_model_parallel(tensor_model_parallel_size=2)
    group = get_tensor_model_parallel_group()
    x = torch.arange(SIZES[rank] * 2, dtype=torch.float32).reshape(SIZES[rank], 2) + 100 * rank
    result = {}
    try:
        mappings._gather_along_first_dim.original(x, group, SIZES)   # megatron's own
        result["unpatched"] = "ok"
    except RuntimeError as err:
        result["unpatched"] = str(err)
    x.requires_grad_(True)
    gathered = mappings.gather_from_sequence_parallel_region(x, group=group, output_split_sizes=SIZES)
    weights = torch.arange(sum(SIZES), dtype=torch.float32)[:, None] * (1 + rank)   # differs per rank
    (gathered * weights).sum().backward()
    result |= {"gathered": gathered.tolist(), "grad": x.grad.tolist()}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def test_uneven_gather_and_its_backward_on_gloo(tmp_path):
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path / "out")), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)]
    assert all("invalid tensor size" in g["unpatched"] for g in got), [g["unpatched"] for g in got]
    rows = [torch.arange(n * 2, dtype=torch.float32).reshape(n, 2) + 100 * r for r, n in enumerate(SIZES)]
    full = torch.cat(rows)
    # the gradient of each rank's rows: the sum over ranks of their weights on those rows
    weight_sum = torch.arange(sum(SIZES), dtype=torch.float32)[:, None] * (1 + 2) * torch.ones(1, 2)
    for r, g in enumerate(got):
        assert torch.equal(torch.tensor(g["gathered"]), full)
        start = sum(SIZES[:r])
        assert torch.equal(torch.tensor(g["grad"]), weight_sum[start:start + SIZES[r]])
