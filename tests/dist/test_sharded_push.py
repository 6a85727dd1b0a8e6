"""A sharded push (weight_sync.sharded: every trainer rank sends the pieces of HF tensors its own
shards cover) lands in the engines bitwise as rank 0's route does, with less on each trainer
link; a trainer rank that fails mid-push fails it on every rank by name with nothing loaded;
the next push works. Real gloo ranks at TP=2 x PP=2 and TP=2 x EP=2, engines of TP=1 and TP=2
whose workers are megarl's real engine-side backend (sharded_push_probe.py)."""
import json

import pytest
from conftest import run_py


@pytest.fixture(scope="module", params=["tp2pp2", "tp2ep2"])
def outcome(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded_push") / "out.json"
    proc = run_py(["tests/dist/sharded_push_probe.py", str(out), request.param], timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    r = json.loads(out.read_text())
    assert r["hung"] == [] and set(r["exitcodes"]) == {0}, r
    ranks = r["ranks"]
    # every rank ends every case with the same outcome (rank 0's word): none left in a collective
    for case in ("rank0", "sharded", "fails", "silent", "sharded_again"):
        errors = {rank: cases[case]["error"] for rank, cases in ranks.items()}
        assert len(set(errors.values())) == 1, (case, errors)
    return request.param, ranks["0"]


def test_every_engine_worker_loads_bitwise_what_rank_0_s_route_loads(outcome):
    layout, r = outcome
    assert r["rank0"]["error"] is None and r["sharded"]["error"] is None, r
    assert r["rank0"]["stats"]["sync_sharded"] == 0.0 and r["sharded"]["stats"]["sync_sharded"] == 1.0
    reference = r["rank0"]["workers"]
    assert len(reference) == 3 and all(w == reference[0] and len(w) > 10 for w in reference)  # tp1 + tp2's two
    assert r["sharded"]["workers"] == reference and r["sharded"]["versions"] == [2, 2]


def test_each_trainer_link_carries_a_share_of_the_model(outcome):
    layout, r = outcome
    whole, link = r["rank0"]["stats"]["sync_link_bytes"], r["sharded"]["stats"]["sync_link_bytes"]
    # 4 ranks own distinct shards; replicated tensors (norms, the router) go from TP rank 0
    assert link < whole / 2.2, (layout, link, whole)
    assert r["sharded"]["stats"]["sync_paused_s"] <= r["sharded"]["stats"]["sync_time_s"]


def test_a_trainer_rank_failing_mid_push_fails_it_by_name_and_loads_nothing(outcome):
    layout, r = outcome
    failed = r["fails"]
    assert failed["engine_error"] and "trainer rank 1" in failed["error"] and "injected" in failed["error"], failed
    assert failed["versions"] == [2, 2] and all(w == {} for w in failed["workers"]), failed
    again = r["sharded_again"]
    assert again["error"] is None and again["versions"] == [5, 5] and again["workers"] == r["rank0"]["workers"]


def test_senders_that_leave_a_tensor_out_fail_the_push_before_anything_is_sent(outcome):
    """A rank that owns tensors but sends none (as one wrongly left out of the senders): the
    engines would keep those tensors' old values, so rank 0 refuses the push, naming them."""
    layout, r = outcome
    silent = r["silent"]
    assert silent["engine_error"] and "do not cover the model" in silent["error"] and "misses" in silent["error"], silent
    assert silent["versions"] == [2, 2] and all(w == {} for w in silent["workers"]), silent
