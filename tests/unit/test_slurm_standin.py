"""The slurm stand-in signals only the processes of its own jobs.

It records each step task's process group and signals it again when the job is cancelled or
ends. By then the task may have been reaped and its pid given to an unrelated process (another
test's server, under pytest-xdist): a pid is only trusted together with the start time it had
when it was recorded.
"""
import signal
import subprocess
import sys
import time

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tests" / "slurm_standin" / "bin"))
import standin  # noqa: E402


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"], start_new_session=True)


def test_a_recorded_group_whose_pid_now_names_another_process_is_left_alone():
    stranger = _sleeper()
    try:
        started = standin.start_time(stranger.pid)
        assert started is not None
        # the record of a task that had this pid before: another start time
        assert standin.kill_tree((stranger.pid, started - 1), signal.SIGKILL) is False
        time.sleep(0.2)
        assert stranger.poll() is None, "the stand-in killed a process that is not its job's"
        # the record of this very process: signalled
        assert standin.kill_tree((stranger.pid, started), signal.SIGKILL) is True
        assert stranger.wait(timeout=10) == -signal.SIGKILL
    finally:
        stranger.kill()
        stranger.wait()


def test_job_groups_are_recorded_with_their_start_times(tmp_path):
    task = _sleeper()
    try:
        standin.add_group(str(tmp_path), task.pid)
        assert standin.groups(str(tmp_path)) == [(task.pid, standin.start_time(task.pid))]
        standin.reap_steps(str(tmp_path), (task.pid, standin.start_time(task.pid)), grace_s=2)
        assert task.wait(timeout=10) == -signal.SIGTERM
        assert standin.groups(str(tmp_path)) == []
    finally:
        task.kill()
        task.wait()

