"""Partial rollout with the real vLLM engine: carry-over across a weight sync."""
import json

import pytest
from conftest import run_py


def test_greedy_sample_carried_over_a_sync_ends_like_an_uninterrupted_one(tiny_model, tmp_path):
    """Contract: a greedy sample interrupted at a round end, carried over a weight sync that
    changes nothing and continued as prompt + partial tokens ends with exactly the tokens of an
    uninterrupted greedy request; its tokens carry version 0 before the sync and 1 after.
    Requests aborted right after submission resolve as aborted, not after their whole budget."""
    out = tmp_path / "carry.json"
    proc = run_py(["tests/e2e/carry_probe.py", str(tiny_model), str(out)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    r = json.loads(out.read_text())
    assert r["first_round_gid"] != 0, "the short prompt must end the first round"
    assert 0 < r["partial_len"] < len(r["reference"]), r["partial_len"]
    assert r["carried"] == r["reference"]
    assert r["carried_logprobs"] == pytest.approx(r["reference_logprobs"], abs=1e-4)
    k = r["partial_len"]
    assert r["versions"] == [0] * k + [1] * (len(r["carried"]) - k)
    assert r["finish_reason"] == "stop" and r["engine_version"] == 1
    # requests aborted before vLLM registered them end at once, not after their 200-token budget
    assert all(reason == "abort" and n < 200 for n, reason in r["early_abort"]), r["early_abort"]
