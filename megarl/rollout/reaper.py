"""Engine processes never outlive the run, however it ends.

An in-process vLLM engine runs its core (and workers) in child processes, and megatron's
checkpoint writer may too. When `megarl train` is SIGKILLed (OOM killer, node drain,
`kill -9`) nothing in it runs again, and those children are re-parented and keep their memory
(and GPUs). A sidecar, in its own session, polls whether its parent is still alive and then
SIGKILLs what it watches (and their children): `guard(pids)` given processes,
`guard_descendants()` every process the parent started while it watched (polled every 0.5 s).
On a normal exit the engines are closed first and the sidecar finds nothing left. (Local
servers also get PR_SET_PDEATHSIG, see servers.py.)
"""
from __future__ import annotations

import os
import subprocess
import sys

_SIDECAR = r"""
import os, sys, time
import psutil
parent, args = int(sys.argv[1]), sys.argv[2:]
everything = args == ["descendants"]
known = {}
def keep(p):
    try:
        known[(p.pid, p.create_time())] = p
    except psutil.NoSuchProcess:
        pass
for a in ([] if everything else args):
    try:
        keep(psutil.Process(int(a)))
    except psutil.NoSuchProcess:
        pass
me = os.getpid()
while psutil.pid_exists(parent) and os.getppid() == parent:
    if everything:
        try:
            for c in psutil.Process(parent).children(recursive=True):
                if c.pid != me:
                    keep(c)
        except psutil.NoSuchProcess:
            break
    elif not any(p.is_running() for p in known.values()):
        sys.exit(0)
    time.sleep(0.5)
victims = []
for p in known.values():
    try:
        if p.is_running():
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
    return _sidecar([str(p) for p in pids])


def guard_descendants() -> subprocess.Popen:
    """SIGKILL every process this one starts from now on (engine cores, checkpoint writers,
    dataloader workers...), with their children, once this process is gone. `megarl train`
    calls it on every rank."""
    return _sidecar(["descendants"])


def _sidecar(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _SIDECAR, str(os.getpid()), *args],
                            start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def new_children(before: set[int]) -> list[int]:
    """Direct children of this process that were not in `before` (pids)."""
    import psutil
    return [c.pid for c in psutil.Process().children() if c.pid not in before]


def children() -> set[int]:
    import psutil
    return {c.pid for c in psutil.Process().children()}
