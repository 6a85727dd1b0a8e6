"""Partial rollout with the real vLLM engine: carry-over across a weight sync."""
import json

import pytest
from conftest import run_py


@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_greedy_sample_carried_over_a_sync_ends_like_an_uninterrupted_one(carry, mode):
    """Contract: a greedy sample interrupted at a round end, carried over a weight sync that
    changes nothing, ends with exactly the tokens of an uninterrupted greedy request; its
    tokens carry the old version before the sync and the new one after. abort: it was aborted
    and continued as prompt + partial tokens (more than one request); keep: the same request
    was held over the update (one request, its KV recomputed under the loaded weights)."""
    r, ref = carry[mode], carry
    assert r["first_round_gid"] != 0, "the short prompt must end the first round"
    assert 0 < r["partial_len"] < len(ref["reference"]), r["partial_len"]
    assert r["carried"] == ref["reference"]
    assert r["carried_logprobs"] == pytest.approx(ref["reference_logprobs"], abs=1e-4)
    k, v = r["partial_len"], r["start_version"]
    assert r["versions"] == [v] * k + [v + 1] * (len(r["carried"]) - k)
    assert r["finish_reason"] == "stop"
    assert (r["requests"] == 1) == (mode == "keep"), r["requests"]


def test_requests_aborted_at_once_end_at_once(carry):
    """Requests aborted right after submission (before vLLM registered them) resolve as
    aborted, not after their whole 200-token budget; the engine ends at the last version."""
    assert all(reason == "abort" and n < 200 for n, reason in carry["early_abort"]), carry["early_abort"]
    assert carry["engine_version"] == 2 and carry["keep"]["start_version"] == 1


@pytest.fixture(scope="module")
def carry(tiny_model, tmp_path_factory):
    """One run of tests/e2e/carry_probe.py (one engine) for the module's tests."""
    out = tmp_path_factory.mktemp("carry") / "carry.json"
    proc = run_py(["tests/e2e/carry_probe.py", str(tiny_model), str(out)], timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(out.read_text())
