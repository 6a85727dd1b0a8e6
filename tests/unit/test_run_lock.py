"""One megarl run per run directory; a run that died does not keep the directory locked."""
import os
import signal
import subprocess
import sys

import pytest

from megarl.checkpoint.run_lock import RunLock
from megarl.config import ConfigError

HOLD = """
import sys, time
from megarl.checkpoint.run_lock import RunLock
RunLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_second_run_is_refused_until_the_first_dies(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"run.dir=.*in use.*pid {holder.pid}.*another run.dir"):
            RunLock(str(tmp_path)).acquire()
        holder.send_signal(signal.SIGKILL)     # a crash: the kernel drops the lock
        holder.wait(timeout=30)
        lock = RunLock(str(tmp_path))
        lock.acquire()
        assert f"pid {os.getpid()}" in open(tmp_path / ".lock").read()
        lock.release()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_lock_is_released_and_retaken_in_one_process(tmp_path):
    first = RunLock(str(tmp_path / "new"))
    first.acquire()
    first.release()
    # flock locks belong to an open file: a second open in this process conflicts unless the
    # first was released, so this raises ConfigError if release() did not release
    again = RunLock(str(tmp_path / "new"))
    again.acquire()
    again.release()
