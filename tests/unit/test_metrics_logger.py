"""metrics.jsonl: one row per step; a resumed run redoes the steps after its checkpoint."""
import json

from megarl.metrics.logger import MetricsLogger


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_fresh_run_truncates_and_resume_drops_rows_after_checkpoint(tmp_path):
    """A fresh run starts an empty file; resuming at step 2 keeps steps 0-1 and drops the rows
    a crashed run logged after its last checkpoint, so each step appears once."""
    log = MetricsLogger(str(tmp_path), 4, tensorboard=True, progress=False)
    for step in range(4):
        log.log(step, {"reward_mean": step / 10})
    log.close()
    assert [r["step"] for r in rows(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))

    log = MetricsLogger(str(tmp_path), 4, tensorboard=False, progress=False, start_step=2)
    log.log(2, {"reward_mean": 0.9})
    log.close()
    got = rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in got] == [0, 1, 2] and got[-1]["reward_mean"] == 0.9

    # a fresh run that trained nothing leaves the file as it was; its first step starts it anew
    MetricsLogger(str(tmp_path), 4, tensorboard=False, progress=False).close()
    assert [r["step"] for r in rows(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    log = MetricsLogger(str(tmp_path), 4, tensorboard=False, progress=False)
    log.log(0, {"reward_mean": 0.5})
    log.close()
    assert [r["step"] for r in rows(tmp_path / "metrics.jsonl")] == [0]


def test_a_run_that_trained_nothing_leaves_no_metrics_file(tmp_path):
    """metrics.jsonl is created at the first logged step, not when the run starts: a run
    stopped before its first step (engines that never came up) leaves none."""
    run = tmp_path / "run"
    MetricsLogger(str(run), 4, tensorboard=False, progress=False).close()
    assert run.is_dir() and not (run / "metrics.jsonl").exists()


def test_trainer_idle_frac_is_the_share_of_the_step_not_training():
    """One definition for the trainer's metric and the simulator's (megarl/metrics/step.py)."""
    from megarl.metrics.step import trainer_idle_frac
    assert trainer_idle_frac(3.0, 4.0) == 0.25
    assert trainer_idle_frac(4.0, 4.0) == 0.0


def test_rollout_metrics_of_a_step():
    from types import SimpleNamespace

    import torch

    from megarl.metrics.step import rollout_metrics
    samples = [SimpleNamespace(response_ids=[1] * n, stopped=n < 4, mask=[], turns=0) for n in (2, 4)]
    out = rollout_metrics(samples, SimpleNamespace(scores=torch.tensor([0.0, 1.0])))
    assert out == {"samples": 2, "response_len_mean": 3.0, "response_len_max": 4,
                   "rollout_slot_utilization": 0.75, "finished_frac": 0.5, "reward_mean": 0.5}
