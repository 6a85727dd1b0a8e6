"""A NaN/Inf never reaches the weights: found before the optimizer step, named with its step."""
import json

import pytest

from conftest import run_py


@pytest.fixture(scope="module")
def outcome(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("nonfinite") / "out.json"
    proc = run_py(["tests/dist/nonfinite_probe.py", str(tiny_model), str(out)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_nan_reward_stops_the_step_by_name(outcome):
    r = outcome["reward_stop"]
    assert "step 3" in r["error"] and "rewards (scores)" in r["error"] and "1 non-finite" in r["error"]
    assert not r["weights_changed"]


def test_nan_reward_with_skip_drops_the_update(outcome):
    r = outcome["reward_skip"]
    assert r["metrics"]["nonfinite_skipped"] == 1.0 and "rewards" in r["metrics"]["nonfinite_reason"]
    assert not r["weights_changed"]


def test_nan_loss_is_caught_in_the_gradients_before_the_optimizer_step(outcome):
    r = outcome["loss_stop"]
    assert "actor gradients" in r["error"] and "step 3" in r["error"]
    assert not r["weights_changed"]


def test_a_finite_step_updates(outcome):
    r = outcome["clean"]
    assert "error" not in r and r["weights_changed"] and "nonfinite_skipped" not in r["metrics"]
