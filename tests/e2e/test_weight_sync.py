"""Trainer -> engine weight sync with the real megatron actor and the real vLLM engine."""
import json

from conftest import run_py


def test_push_makes_engine_match_trainer_and_skipped_push_is_detected(tiny_model, tmp_path):
    """After a push, engine logprobs of sampled tokens equal the trainer's within 1e-3 (fp32);
    after an update whose push is skipped, the gap is large and `verify` raises."""
    out = tmp_path / "probe.json"
    proc = run_py(["tests/e2e/sync_probe.py", str(tiny_model), str(out)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["after_initial_push"] < 1e-3
    assert r["after_push"] < 1e-3
    assert r["push_skipped"] > 1e-2, r
    assert r["verify_raised"] and "weight version 0" in r["verify_message"]
    assert r["engine_version"] == 1
    assert r["sync"]["sync_bytes"] > 0
