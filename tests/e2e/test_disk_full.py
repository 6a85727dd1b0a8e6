"""A checkpoint save on a filesystem that fills: one clear line, nothing half-written left."""
import json

from conftest import run_py


def test_disk_filling_during_a_save_is_one_clear_error_and_leaves_nothing(tiny_model, remote_engine, tmp_path,
                                                                          small_disk):
    """checkpoint.dir on a 10 MiB tmpfs (a tiny-model checkpoint is ~17 MiB): the first save
    runs out of space mid-write. The run stops with exit code 1 and one line naming the
    folder, the cause and the fix (no traceback); the partial folder is removed; the step's
    metrics row is kept."""
    disk = small_disk(10)
    run_dir = tmp_path / "run"
    proc = run_py(["-m", "megarl.cli", "train", "recipes/tiny_cpu.yaml", f"model.path={tiny_model}",
                   f"data.prompts={tiny_model}/prompts.jsonl", f"run.dir={run_dir}", "train.steps=1",
                   f"checkpoint.dir={disk}", *remote_engine.overrides], env=remote_engine.env)
    assert proc.returncode == 1, proc.stderr[-4000:]
    # (the multiprocessing resource tracker may print its own warnings after ours)
    last = [line for line in proc.stderr.splitlines() if line.startswith("megarl: ")][-1]
    assert last.startswith("megarl: checkpoint not saved: checkpoint step_0 could not be written to "
                           f"{disk}: No space left on device"), proc.stderr[-4000:]
    assert "checkpoint.dir" in last and "no checkpoint was saved yet" in last
    assert "Traceback" not in proc.stderr
    assert list(disk.iterdir()) == [], list(disk.iterdir())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0]
