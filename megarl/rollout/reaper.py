"""Engine processes never outlive the run, however it ends.

An in-process vLLM engine runs its core (and workers) in child processes, and megatron's
checkpoint writer may too. When `megarl train` is SIGKILLed (OOM killer, node drain,
`kill -9`) nothing in it runs again, and those children are re-parented and keep their memory
(and GPUs). `guard_descendants()` starts a sidecar, in its own session, that records the
parent's descendants every 0.5 s and SIGKILLs them once the parent is gone. On a normal exit
the engines are closed first and the sidecar finds nothing left. (Local servers also get
PR_SET_PDEATHSIG, see servers.py.)
"""
from __future__ import annotations

import os
import subprocess
import sys

import psutil

_SIDECAR = r"""
import os, sys, time
import psutil
parent, me, known = int(sys.argv[1]), os.getpid(), {}
while psutil.pid_exists(parent) and os.getppid() == parent:
    try:
        for c in psutil.Process(parent).children(recursive=True):
            if c.pid != me:
                known[(c.pid, c.create_time())] = c   # (pid, start time): never a reused pid
    except psutil.NoSuchProcess:
        break
    time.sleep(0.5)
for p in known.values():
    try:
        for v in [p] + p.children(recursive=True):
            v.kill()
    except psutil.NoSuchProcess:
        pass
"""


def guard_descendants() -> subprocess.Popen:
    """SIGKILL every process this one starts (engine cores, checkpoint writers, dataloader
    workers...), with their children, once this process is gone. `megarl train` calls it on
    every rank."""
    return subprocess.Popen([sys.executable, "-c", _SIDECAR, str(os.getpid())],
                            start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pid_alive(pid: int) -> bool:
    """Is process `pid` running? An exited child its parent has not reaped yet (a zombie)
    counts as gone; one we may not signal (another user's) as running."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
