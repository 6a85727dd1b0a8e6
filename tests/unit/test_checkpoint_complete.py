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


def test_a_disk_error_is_found_inside_torch_checkpoint_exceptions():
    """torch.distributed.checkpoint reports a writer's OSError inside a CheckpointException
    ({rank: (exception, traceback)}), itself raised from megatron's code: the save's handler
    must still see ENOSPC (and let any other error through untouched)."""
    import errno
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from megarl.checkpoint.manager import _disk_errno
    full = OSError(errno.ENOSPC, "No space left on device")
    wrapped = CheckpointException("save failed", {0: (full, traceback.StackSummary())})
    try:
        try:
            raise wrapped
        except CheckpointException as err:
            raise RuntimeError("megatron: save failed") from err
    except RuntimeError as outer:
        assert _disk_errno(outer) == errno.ENOSPC
    # megatron's writer workers send their error back as text (seen with a full tmpfs)
    assert _disk_errno(RuntimeError("Worker failure: [Errno 28] No space left on device")) == errno.ENOSPC
    assert _disk_errno(CheckpointException("x", {1: (ValueError("bad"), None)})) is None
    assert _disk_errno(ValueError("no disk involved")) is None


def test_room_check_names_the_need_the_space_and_the_intact_checkpoint(tmp_path):
    from megarl.checkpoint.manager import folder_bytes, room_problem
    prev = tmp_path / "step_3"
    (prev / "actor").mkdir(parents=True)
    (prev / "actor" / "w.bin").write_bytes(b"\0" * (3 << 20))
    need = folder_bytes(prev)
    assert need == 3 << 20
    assert room_problem(tmp_path, need, need, 4, prev) is None
    msg = room_problem(tmp_path, need, 1 << 20, 4, prev)
    assert "step_4 needs about 3 MiB" in msg and "1 MiB free" in msg and str(prev) in msg
    assert "checkpoint.dir" in msg
