"""The slurm stand-in signals only the processes of its own jobs.

It records each step task's process group and signals it again when the job is cancelled or
ends. By then the task may have been reaped and its pid given to an unrelated process (another
test's server, under pytest-xdist): a pid is only trusted together with the start time it had
when it was recorded.
"""
import os
import signal
import subprocess
import sys
import time

from conftest import ROOT

BIN = ROOT / "tests" / "slurm_standin" / "bin"
sys.path.insert(0, str(BIN))
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



def test_what_a_finished_task_left_running_ends_with_the_step(tmp_path):
    """A task that started a process in a session of its own and exited (a torchrun killed
    before its ranks) leaves that process re-parented: to srun, a subreaper, which ends it with
    the step, as slurm's cgroup would; re-parented to init it would outlive the job."""
    state, pidfile = tmp_path / "state", tmp_path / "orphan.pid"
    (state / "job7").mkdir(parents=True)
    env = {**os.environ, "SLURM_STANDIN_STATE": str(state), "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"}
    task = f"setsid sleep 300 >/dev/null 2>&1 & echo $! > {pidfile}"
    proc = subprocess.run([str(BIN / "srun"), "--ntasks=1", "sh", "-c", task],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    orphan = int(pidfile.read_text())
    deadline = time.time() + 10
    while standin.start_time(orphan) is not None and _state(orphan) != "Z" and time.time() < deadline:
        time.sleep(0.1)
    assert standin.start_time(orphan) is None or _state(orphan) == "Z", "the orphan outlived its step"


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
