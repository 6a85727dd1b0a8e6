"""The carry's l_old at scale (split over DP by the step's batching rule, tensors) and the `kl`
metric under stitching, on 2 real gloo ranks (tests/dist/old_logprob_probe.py)."""
import json

import pytest
from conftest import run_py

from megarl.ppo.microbatch import carry_layout


@pytest.fixture(scope="module")
def ranks(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("old_logprobs") / "out.json"
    proc = run_py(["-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                   "tests/dist/old_logprob_probe.py", str(tiny_model), str(out)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_dp_split_gives_the_one_rank_values(ranks):
    assert len(ranks) == 2
    for r in ranks:   # rank 1 was given no samples: it got them as tensors from rank 0
        c = r["carry"]
        assert c["count"] == 61 and c["lengths_ok"], (r["rank"], c)
        # the same forward in other micro-batch shapes: 1.7e-6 to 1.9e-6 apart (1 thread,
        # MKL_CBWR=COMPATIBLE, ATEN_CPU_CAPABILITY=default), as the layout tests' logprobs before
        # an update (tests/dist/parity.py, up to 5.7e-6); a row's values shifted by a position
        # give another token's logprob
        assert c["max_abs_diff"] < 5e-5, (r["rank"], c)
        assert r["carry_empty"] == []


def test_each_dp_rank_computes_its_share_in_micro_batches(ranks):
    # 61 rows over dp=2 with train.micro_batch_size=8 (ppo/microbatch.py): 31 and 30 rows, 4
    # micro-batches of at most 8 on each rank, every row once, no filler; not 61 rows on every
    # rank one at a time
    calls = [r["carry"]["forward_rows"] for r in ranks]
    assert [len(c) for c in calls] == [4, 4], calls
    assert all(0 < n <= 8 for c in calls for n in c) and sum(map(sum, calls)) == 61, calls


def test_kl_metric_is_the_current_weights_estimate_for_every_kl_kind(ranks):
    kl = ranks[0]["kl"]
    for kind, v in kl.items():
        assert abs(v["expected"]) > 1e-4, v    # the actor was moved off the reference
        assert abs(v["metric"] - v["expected"]) < 1e-5, (kind, v)   # a mean of ~0.12: noise <= 3e-8


def test_no_reference_model_without_a_kl_term(ranks):
    """algo.kl_coef=0 (GRPO: no critic): only the actor is built, the step runs no reference
    pass and reports no KL; with algo.kl_coef > 0 the reference is built and the KL reported."""
    for r in ranks:
        off, on = r["no_reference"]["kl0"], r["no_reference"]["kl"]
        assert off["models_built"] == 1 and not off["reference"], off
        assert on["models_built"] == 2 and on["reference"], on
        assert "kl" not in off["keys"] and "kl_penalty" not in off["keys"], off["keys"]
        assert {"kl", "kl_penalty"} <= set(on["keys"]), on["keys"]
        assert set(on["keys"]) - set(off["keys"]) == {"kl", "kl_penalty"}


@pytest.mark.parametrize("count,dp,mbs,want", [
    (61, 1, 16, (64, 16)), (3, 1, 16, (3, 3)), (17, 1, 16, (18, 9)), (61, 2, 8, (32, 8)),
    (1, 4, 8, (1, 1)), (64, 2, 16, (32, 16)),
])
def test_carry_layout_pads_less_than_a_row_per_micro_batch(count, dp, mbs, want):
    rows, size = carry_layout(count, dp, mbs)
    assert (rows, size) == want
    assert rows % size == 0 and size <= mbs and rows * dp >= count
    assert rows * dp - count < rows // size * dp   # padding < one row per micro-batch
