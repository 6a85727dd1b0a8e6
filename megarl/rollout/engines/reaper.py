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

import atexit
import functools
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Optional

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
    every rank. A session of its own on purpose: a signal to the trainer's group or session
    must not reach it (it acts once the trainer is gone); it sleeps between polls, so its
    scheduling group costs nothing."""
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


def remove_stale(base: str, prefix: str) -> list[str]:
    """Remove the folders `<base>/<prefix><pid>-...` whose process is gone (what a killed run
    left: staged weights, engine sockets). Returns what was removed."""
    removed = []
    for path in glob.glob(os.path.join(base, prefix + "*")):
        try:
            pid = int(os.path.basename(path)[len(prefix):].split("-")[0])
        except ValueError:
            continue
        if not pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


RPC_PREFIX = "megarl-rpc-"
_UNIX_SOCKET_PATH_MAX = 107          # sun_path is 108 bytes with its terminating NUL


@functools.cache
def private_rpc_dir() -> Optional[str]:
    """One owner-only folder for the ZMQ sockets of this process's vLLM engines (decided once).

    vLLM creates its IPC sockets as `$VLLM_RPC_BASE_PATH/<uuid>` (default: the temp folder)
    and leaves them there: about three files per engine start pile up in /tmp of every node.
    Here they go into `<tmp>/megarl-rpc-<pid>-*`, removed when this process exits and, if it
    was killed, by the next megarl process's `remove_stale`. In-process engines read it from
    this process's environment, servers from `LocalServer.env()`. A VLLM_RPC_BASE_PATH the
    user set is kept (one inherited from another megarl process is not the user's); so is
    vLLM's default when the folder would make socket paths too long for Unix sockets.
    Returns the folder used (None: vLLM's default)."""
    preset = os.environ.get("VLLM_RPC_BASE_PATH")
    if preset and not os.path.basename(preset.rstrip("/")).startswith(RPC_PREFIX):
        return preset
    base = tempfile.gettempdir()
    remove_stale(base, RPC_PREFIX)
    path = tempfile.mkdtemp(prefix=f"{RPC_PREFIX}{os.getpid()}-", dir=base)   # mode 0700
    if len(os.path.join(path, "x" * 36)) > _UNIX_SOCKET_PATH_MAX:             # <uuid4> inside
        os.rmdir(path)
        os.environ.pop("VLLM_RPC_BASE_PATH", None)
        return None
    os.environ["VLLM_RPC_BASE_PATH"] = path
    atexit.register(shutil.rmtree, path, True)
    return path
