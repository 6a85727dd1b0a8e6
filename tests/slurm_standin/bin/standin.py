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


def start_time(pid: int):
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22), or None if no
    process has that id. A pid and its start time name one process: after it is reaped its pid
    may be given to an unrelated one, which then has another start time."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def add_group(job: str, pgid: int) -> None:
    """Record a step task's process group (its leader's pid and start time)."""
    with open(os.path.join(job, "pgids"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.write(f"{pgid} {start_time(pgid)}\n")


def groups(job: str) -> list:
    """[(pgid, leader start time)] of the job's step tasks."""
    try:
        with open(os.path.join(job, "pgids")) as fh:
            return [(int(a), int(b)) for a, b in (line.split() for line in fh if line.strip())]
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


def kill_tree(group, sig) -> bool:
    """`sig` to the process group of `group` = (leader pid, its start time) and to every
    descendant of the leader; True if any was there. A pid now held by another process (the
    leader was reaped and its pid reused) is left alone. With the leader gone its group may live
    on, and while it does its id is not reused, so signalling the group stays safe."""
    pid, started = group
    now = start_time(pid)
    if started is not None and now is not None and now != started:
        return False
    below = descendants(pid)    # first: once the group is signalled they may be re-parented
    hit = killpg(pid, sig)
    for p in below:
        try:
            os.kill(p, sig)
            hit = True
        except (ProcessLookupError, PermissionError):
            pass
    return hit


def kill_job(job: str, sig, batch) -> None:
    """`sig` to the batch shell's tree (batch = (pid, start time)) and every step's."""
    for group in [batch] + groups(job):
        kill_tree(group, sig)


def reap_steps(job: str, batch, grace_s: float = 5.0) -> None:
    """The job has ended: SIGTERM, then SIGKILL, whatever its batch shell and steps left."""
    alive = [g for g in [batch] + groups(job) if kill_tree(g, signal.SIGTERM)]
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [g for g in alive if start_time(g[0]) in (None, g[1]) and (killpg(g[0], 0) or descendants(g[0]))]
    for g in alive:
        kill_tree(g, signal.SIGKILL)
    clear(os.path.join(job, "pgids"))
