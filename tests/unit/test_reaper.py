"""Processes a trainer started die with it when it is SIGKILLed (engine cores and a
checkpoint writer used to be orphaned, holding memory)."""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

PARENT = """
import subprocess, sys, time
from megarl.rollout import reaper
def sleeper():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
{body}
time.sleep(1.5)                      # a poll of the watch sees the child
print(child.pid, flush=True)
time.sleep(600)
"""
BEFORE = "child = sleeper()\nreaper.guard_descendants()"
AFTER = "reaper.guard_descendants()\ntime.sleep(0.3)\nchild = sleeper()"


@pytest.mark.parametrize("body", [BEFORE, AFTER], ids=["started_before_the_watch", "started_after"])
def test_children_die_when_the_parent_is_killed(body):
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(body=body)], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    try:
        assert psutil.pid_exists(child_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                if psutil.Process(child_pid).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the child outlived its SIGKILLed parent by 10 s")
    finally:
        if parent.poll() is None:
            parent.kill()
        try:
            os.kill(child_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
