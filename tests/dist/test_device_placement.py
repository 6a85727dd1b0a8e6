"""Every tensor megarl makes for the models is on the trainer's device, checked on CPU.

A CPU-only machine cannot see a batch left on the host (everything is on the CPU), so
`DeviceGuard` follows where each tensor *would* be on a GPU and fails on a mix. The probe runs
the trainer's side of a step (stitching logprobs, PPO with critic and reference, GRPO, a
weight push, the stop vote) on 2 gloo ranks under the guard, then leaves one batch field on
the host to show the guard catches it.
"""
import json
import os

import pytest
import torch
from conftest import run_py

from megarl.distributed import device as dev
from megarl.distributed.device_guard import DEVICE, HOST, DeviceGuard, MixedDeviceError, placement


@pytest.fixture(scope="module")
def probe(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("device") / "out.json"
    proc = run_py(["-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                   "tests/dist/device_probe.py", str(tiny_model), str(out),
                   "leave=tokens,behav_logp,resp_mask", "train.mini_batches=2", "train.ppo_epochs=1"],
                  timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_training_step_keeps_every_tensor_on_the_device(probe):
    for algo in ("ppo", "grpo"):
        m = probe["clean"][algo]
        assert m["grad_norm"] > 0 and all(v == v for v in m.values()), (algo, m)
    assert probe["clean"]["ppo"]["critic_grad_norm"] > 0


def test_megarl_reads_results_back_per_step_not_per_micro_batch(probe):
    # 2 mini-batches x 1 epoch = 2 optimizer steps per trained model (actor, and critic in
    # PPO); each rank has 16 rows per mini-batch = 4 micro-batches: a read per micro-batch
    # would show 8 or more times at one line
    for algo, sites in probe["sync_sites"].items():
        ours = {s: n for s, n in sites.items() if f"{os.sep}megarl{os.sep}" in s and ".venv" not in s}
        assert ours, algo
        models = 2 if algo == "ppo" else 1
        assert max(ours.values()) <= 2 * models, (algo, ours)
        # the micro-batch plans (one per pass and mini-batch) read the rows' lengths from the
        # host: a batch built from samples has them, and the mini-batches carry them along
        planned = {s: n for s, n in ours.items() if "plan_batch(" in s}
        assert not planned, (algo, planned)


@pytest.mark.parametrize("field", ["tokens", "behav_logp", "resp_mask"])
def test_a_field_left_on_the_host_fails_like_a_gpu_run(probe, field):
    message = probe["left"][field]
    assert message is not None, f"batch.{field} on the host went unnoticed"
    assert "mixes host tensor" in message and "device.put" in message


def test_guard_rules_in_process():
    weight = torch.nn.Parameter(torch.randn(10, 4))   # exists before: a model parameter
    with DeviceGuard() as guard:
        ids = torch.tensor([[1, 2, 3]])
        assert placement(ids) == HOST
        with pytest.raises(MixedDeviceError, match="embedding"):
            torch.nn.functional.embedding(ids, weight)
        x = torch.nn.functional.embedding(dev.put(ids), weight)
        assert placement(x) == DEVICE
        assert placement(torch.zeros(2, device=x.device)) == DEVICE
        assert placement(torch.zeros_like(ids)) == HOST
        y = x * torch.tensor(2.0)                        # a 0-d host scalar is allowed
        rows = torch.tensor([0])
        assert placement(y[0][rows]) == DEVICE            # host indices are allowed
        with pytest.raises(MixedDeviceError, match="device indices"):
            ids[0][dev.put(rows)]                          # device indices into a host tensor are not
        with pytest.raises(MixedDeviceError, match="setitem"):
            y[0, 1:] = torch.zeros(2, 4)
        host = y.cpu()
        assert placement(host) == HOST and placement(y) == DEVICE
        host.tolist()
        assert guard.syncs == 0
        float(y.sum())
        assert guard.syncs == 1


def test_guard_is_inactive_outside_its_block():
    with DeviceGuard():
        assert placement(torch.zeros(2)) == HOST
    assert placement(torch.zeros(2)) is None            # nothing follows tensors any more
