"""An MoE actor's router metrics (megarl/ppo/moe_metrics.py) are the same at 1 rank and with the
experts over 2 ranks (parallel.ep=2: dp=2), on the same data, through layout_probe.py (the tiny
Qwen3-MoE of test_moe_layouts.py, 2 PPO steps, a critic built from the same MoE checkpoint):

- `padded` (train.remove_padding=false: both layouts run the same micro-batches, each rank half
  of them), load-balancing loss and z-loss on: every moe_* figure agrees. megatron's router
  losses are per micro-batch, so they agree only where the micro-batches hold the same rows.
- `packed` (the default batching: each layout pads its micro-batches its own way), router
  losses off (the layouts' updates then agree, test_moe_layouts.py): the token shares agree,
  padding excluded.

Tolerance: relative 1e-5. Noise: the padded layouts differ by <= 1.1e-7 relative (measured on
an AMD EPYC, 2 steps); the token shares are exact counts (difference 0.0). Catch: each rank
reporting its own figures (no reduction over DP) moved the z-loss by 9.9% and the largest
expert share by 3.8% at EP=2."""
import json

import pytest
from conftest import run_py
from test_moe_layouts import moe_model  # noqa: F401  (the module's own instance of the tiny MoE)

RTOL = 1e-5
SHARES = ("moe_expert_share_max", "moe_expert_share_min", "moe_imbalance", "moe_imbalance_max")
LOSSES = ("moe_aux_loss", "moe_aux_loss_max", "moe_z_loss", "moe_z_loss_max")
CASES = {"padded": ["train.remove_padding=false", "moe.aux_loss_coeff=0.01", "moe.z_loss_coeff=0.001"],
         "packed": ["moe.load_balancing=none"]}


@pytest.fixture(scope="module")
def runs(moe_model, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("moe_metrics")
    out = {}
    for nproc, layout in ((1, []), (2, ["parallel.ep=2"])):
        args = [a for name, case in CASES.items() for a in ["--case", name, "train.steps=2", *layout, *case]]
        path = tmp / f"world{nproc}.json"
        launch = ["tests/dist/layout_probe.py"] if nproc == 1 else [
            "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", "tests/dist/layout_probe.py"]
        proc = run_py(launch + [str(moe_model), str(path), *args])
        assert proc.returncode == 0, proc.stderr[-6000:]
        out[nproc] = json.loads(path.read_text())
    return out


def far(a: float, b: float) -> bool:
    return abs(a - b) > RTOL * max(abs(a), abs(b))


@pytest.mark.parametrize("case,keys", [("padded", SHARES + LOSSES), ("packed", SHARES)])
def test_expert_parallel_reports_what_one_rank_reports(runs, case, keys):
    one, two = runs[1][case], runs[2][case]
    assert len(one) == len(two) == 2
    for step, (a, b) in enumerate(zip(one, two)):
        assert set(keys) <= set(a), sorted(a)
        bad = {k: (a[k], b[k]) for k in keys if far(a[k], b[k])}
        assert not bad, f"step {step}: 1 rank vs EP=2 {bad}"
        assert all(a[k] > 0 for k in keys if k in LOSSES), a   # on, the losses are never 0
        # 4 experts, top-2: a share lies in (0, 1/2]; the imbalance in [1, 2]
        assert 0 < a["moe_expert_share_min"] <= 0.25 <= a["moe_expert_share_max"] <= 0.5
        assert 1 <= a["moe_imbalance"] <= a["moe_imbalance_max"] <= 2


def test_router_losses_are_reported_only_when_on(runs):
    assert all(k in runs[1]["padded"][0] for k in LOSSES)
    assert not any(k in runs[1]["packed"][0] for k in LOSSES), runs[1]["packed"][0]
