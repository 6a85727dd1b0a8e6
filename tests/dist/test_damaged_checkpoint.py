"""A damaged checkpoint (a shard deleted or cut short after its save) is found from its files
before any rank loads it: resume takes the newest intact one with a warning naming the broken
one, or stops with one line when none is intact (tests/dist/checkpoint_probe.py, real
megatron dist checkpoints of actor and critic with their optimizers)."""
import json

import pytest
from conftest import run_py


@pytest.fixture(scope="module")
def probe(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("damaged_checkpoint")
    proc = run_py(["tests/dist/checkpoint_probe.py", str(tiny_model), str(out)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "out.json").read_text())


def test_intact_checkpoints_pass(probe):
    assert probe["intact"] == [None, None] and probe["intact_pick"] == "step_1"
    assert any(f.startswith("actor/") and f.endswith(".distcp") for f in probe["files"]), probe["files"]


def test_a_missing_shard_is_named_and_the_previous_checkpoint_is_resumed(probe):
    assert probe["missing_problem"] == f"actor/{probe['missing_shard']} is missing"
    assert probe["missing_pick"] == "step_0" and probe["loaded_step"] == 0
    (warning,) = probe["missing_warnings"]
    assert "step_1 is damaged" in warning and probe["missing_shard"] in warning and "resuming from step_0" in warning


def test_every_checkpoint_damaged_stops_with_one_line(probe):
    assert "critic/" in probe["cut_problem"] and "is cut short" in probe["cut_problem"]
    msg = probe["all_damaged"]
    assert msg and "every checkpoint is damaged" in msg and "step_1: actor/" in msg and "step_0: critic/" in msg
    assert "\n" not in msg


def test_unreadable_metadata_and_driver_state(probe):
    assert probe["metadata_problem"] == "critic/.metadata does not load (UnpicklingError)" or \
        probe["metadata_problem"].startswith("critic/.metadata does not load")
    assert probe["driver_problem"].startswith("driver.pt does not load")

