"""A trainer-side error in the middle of a collective weight push at PP=2 (TP=2) ends the push
on every rank with the same named EngineError, no rank left blocked in a PP relay or in the
outcome broadcast, and the next push works (real gloo ranks: push_errors_probe.py)."""
import json

import pytest
from conftest import run_py


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    out = tmp_path_factory.mktemp("push_errors") / "out.json"
    proc = run_py(["tests/dist/push_errors_probe.py", str(out)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


def test_every_rank_exits_on_its_own(outcome):
    """No rank is still blocked when the probe's hang guard fires (a relay or broadcast that
    waits for a rank which left would hold it until the process-group timeout, or forever)."""
    assert outcome["hung"] == [] and outcome["exitcodes"] == [0, 0, 0, 0], outcome


@pytest.mark.parametrize("case,cause", [("stage0", "stage 0 on rank 0"), ("stage1", "stage 1 on rank 2")])
def test_a_stage_error_is_the_same_named_error_on_every_rank(outcome, case, cause):
    """The KeyError of one stage's conversion (on both its TP ranks) reaches every rank as the
    push's EngineError naming the stage, its relaying rank and the cause; nothing timed out."""
    for rank, cases in outcome["ranks"].items():
        got = cases.get(case)
        assert got is not None, f"rank {rank} never finished case {case}: {cases}"
        assert got["engine_error"], f"rank {rank}: {got}"
        assert cause in got["error"] and "KeyError" in got["error"] and "no HF name" in got["error"], \
            f"rank {rank}: {got}"
    assert outcome["ranks"]["0"][case]["engine_version"] == 1     # the failed push left no new version


def test_the_errors_come_mid_push(outcome):
    """Guard against a vacuous setup: each error comes after buckets went out (stage 0's own
    layer 0; stage 1's layer 2, relayed), and after stage 0's error the buckets stage 1 still
    relays are received but not sent on."""
    r0 = outcome["ranks"]["0"]
    assert 0 in r0["stage0"]["staged_layers"] and not {2, 3} & set(r0["stage0"]["staged_layers"]), r0
    assert {0, 1, 2} <= set(r0["stage1"]["staged_layers"]), r0


def test_pushes_before_and_after_the_errors_deliver_every_tensor(outcome):
    """Guard against a vacuous setup, and proof that the errors left the ranks' point-to-point
    streams in step: the clean pushes around them reach the engine whole, on every rank."""
    for rank, cases in outcome["ranks"].items():
        assert cases["clean"]["error"] is None and cases["clean_again"]["error"] is None, f"rank {rank}: {cases}"
    r0 = outcome["ranks"]["0"]
    assert r0["clean"]["engine_version"] == 1 and r0["clean_again"]["engine_version"] == 4
    assert r0["clean"]["engine_tensors"] == r0["clean_again"]["engine_tensors"] == outcome["hf_tensors"]
