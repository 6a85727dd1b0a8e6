"""One run per run directory: an advisory lock that a dead run cannot leave behind.

`<run_dir>/.lock` is held with flock(2) by rank 0 for the life of `megarl train`; the kernel
drops it when the process ends, however it ends (SIGKILL included), so a crashed run never
blocks its own resume. The file records the holder's host and pid for the error message.
(On cluster file systems flock must be enabled, e.g. Lustre's `flock` mount option; where it
is not, locking fails open with a warning rather than blocking every run.)
"""
from __future__ import annotations

import errno
import fcntl
import os
import socket
import warnings

from megarl.config import ConfigError


class RunLock:
    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, ".lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            if err.errno in (errno.EAGAIN, errno.EACCES):
                raise ConfigError(
                    f"run.dir={os.path.dirname(self.path)!r} is in use by a running megarl train ({holder}): "
                    f"wait for it to finish, stop it, or choose another run.dir") from None
            warnings.warn(f"run.dir lock not available on this file system ({err}); not locking")
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
