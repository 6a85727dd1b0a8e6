"""Only checkpoints whose save finished are ever resumed from."""
from megarl.checkpoint.manager import complete_checkpoints


def test_half_written_checkpoints_are_never_taken(tmp_path):
    for name, complete in [("step_3", True), ("step_12", True), ("step_20", False), ("tmp_step_25", True),
                           ("step_x", True)]:
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / "COMPLETE").write_text(name)
    # a save killed before COMPLETE (step_20) or before the rename (tmp_step_25) is ignored;
    # numeric order, not text order
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_3", "step_12"]
    assert complete_checkpoints(tmp_path / "missing") == []
