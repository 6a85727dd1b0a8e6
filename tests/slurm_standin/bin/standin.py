"""Helpers of the slurm stand-in's sbatch and srun (not a command): job state on disk."""
import fcntl
import os
import signal
import time


def state_dir() -> str:
    path = os.environ.get("SLURM_STANDIN_STATE") or os.path.join(
        os.environ.get("TMPDIR", "/tmp"), f"slurm-standin-{os.getuid()}")
    os.makedirs(path, exist_ok=True)
    return path


def job_dir(job_id) -> str:
    return os.path.join(state_dir(), f"job{job_id}")


def next_id(path: str, start: int) -> int:
    """An id one higher than the last one handed out from `path` (file-locked)."""
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.seek(0)
        text = fh.read().strip()
        value = int(text) + 1 if text else start
        fh.seek(0)
        fh.truncate()
        fh.write(str(value))
    return value


def write(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


def clear(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def add_group(job: str, pgid: int) -> None:
    with open(os.path.join(job, "pgids"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.write(f"{pgid}\n")


def groups(job: str) -> list:
    try:
        with open(os.path.join(job, "pgids")) as fh:
            return [int(x) for x in fh.read().split()]
    except FileNotFoundError:
        return []


def killpg(pgid: int, sig) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def descendants(pid: int) -> list:
    """Every process below `pid` now (from /proc): what slurm's cgroup would hold, including
    processes that started their own session (torchrun's workers, megarl's reaper)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int, sig) -> bool:
    """`sig` to the process group led by `pid` and to every descendant; True if any was there."""
    hit = killpg(pid, sig)
    for p in descendants(pid):
        try:
            os.kill(p, sig)
            hit = True
        except (ProcessLookupError, PermissionError):
            pass
    return hit


def kill_job(job: str, sig, batch_pid: int) -> None:
    for pgid in [batch_pid] + groups(job):
        kill_tree(pgid, sig)


def reap_steps(job: str, batch_pid: int, grace_s: float = 5.0) -> None:
    """The job has ended: SIGTERM, then SIGKILL, whatever its batch shell and steps left."""
    pgids = [batch_pid] + groups(job)
    alive = [p for p in pgids if kill_tree(p, signal.SIGTERM)]
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if killpg(p, 0) or descendants(p)]
    for p in alive:
        kill_tree(p, signal.SIGKILL)
    clear(os.path.join(job, "pgids"))
