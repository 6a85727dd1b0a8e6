"""Engine processes never outlive the run, however it ends.

An in-process vLLM engine runs its core (and workers) in child processes. When `megarl train`
is SIGKILLed (OOM killer, node drain, `kill -9`) nothing in it runs again, and those children
are re-parented and keep their memory (and GPUs). `guard(pids)` starts a small sidecar, in its
own session, that polls whether its parent is still alive and SIGKILLs `pids` (and their
children) once it is not; on a normal exit the engines are closed first and the sidecar finds
nothing left. (Local servers also get PR_SET_PDEATHSIG, see servers.py.)
"""
from __future__ import annotations

import os
import subprocess
import sys

_SIDECAR = r"""
import os, sys, time
import psutil
parent, pids = int(sys.argv[1]), [int(p) for p in sys.argv[2:]]
procs = []
for p in pids:
    try:
        procs.append(psutil.Process(p))
    except psutil.NoSuchProcess:
        pass
while procs and psutil.pid_exists(parent) and os.getppid() == parent:
    time.sleep(0.5)
    procs = [p for p in procs if p.is_running()]
victims = []
for p in procs:
    try:
        victims += [p] + p.children(recursive=True)
    except psutil.NoSuchProcess:
        pass
for v in victims:
    try:
        v.kill()
    except psutil.NoSuchProcess:
        pass
"""


def guard(pids: list[int]) -> subprocess.Popen | None:
    """SIGKILL `pids` (with their children) when this process dies. Returns the sidecar."""
    if not pids:
        return None
    return subprocess.Popen([sys.executable, "-c", _SIDECAR, str(os.getpid()), *map(str, pids)],
                            start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def new_children(before: set[int]) -> list[int]:
    """Direct children of this process that were not in `before` (pids)."""
    import psutil
    return [c.pid for c in psutil.Process().children() if c.pid not in before]


def children() -> set[int]:
    import psutil
    return {c.pid for c in psutil.Process().children()}
