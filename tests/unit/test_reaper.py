"""Engine child processes die with a SIGKILLed trainer (they used to be orphaned, holding memory)."""
import os
import signal
import subprocess
import sys
import time

import psutil

PARENT = """
import subprocess, sys, time
from megarl.rollout import reaper
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
grandchild_holder = reaper.guard([child.pid])
print(child.pid, flush=True)
time.sleep(600)
"""


def test_guarded_children_die_when_the_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
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
            raise AssertionError("the guarded child outlived its SIGKILLed parent by 10 s")
    finally:
        if parent.poll() is None:
            parent.kill()
        try:
            os.kill(child_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


LATER = """
import subprocess, sys, time
from megarl.rollout import reaper
reaper.guard_descendants()
time.sleep(0.3)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])   # started after
time.sleep(1.5)                                                                     # a poll sees it
print(child.pid, flush=True)
time.sleep(600)
"""


def test_descendants_started_later_die_too():
    parent = subprocess.Popen([sys.executable, "-c", LATER], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    try:
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
            raise AssertionError("a descendant started after the watch outlived its SIGKILLed parent")
    finally:
        if parent.poll() is None:
            parent.kill()
        try:
            os.kill(child_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
