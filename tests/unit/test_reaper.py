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
from megarl.rollout.engines import reaper
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


@pytest.fixture
def short_tmp():
    """A temp folder with a short path (socket paths must stay under 108 bytes)."""
    import shutil
    import tempfile
    from pathlib import Path
    path = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _rpc(tmp_path, env_extra=None, code=""):
    """private_rpc_dir() in a fresh process whose temp folder is tmp_path/t; its output lines."""
    tmp = tmp_path / "t"
    tmp.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"}
    env.update(TMPDIR=str(tmp), **(env_extra or {}))
    body = ("import os, stat\nfrom megarl.rollout.engines import reaper\n"
            "p = reaper.private_rpc_dir()\nassert reaper.private_rpc_dir() == p\n"
            "print(p)\nprint(os.environ.get('VLLM_RPC_BASE_PATH'))\n"
            "print(oct(stat.S_IMODE(os.stat(p).st_mode)) if p and os.path.isdir(p) else None)\n" + code)
    out = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return tmp, out.stdout.splitlines()


def test_engine_sockets_get_a_private_folder_removed_at_exit(short_tmp):
    tmp_path = short_tmp
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tmp = tmp_path / "t"
    tmp.mkdir()
    (tmp / f"megarl-rpc-{dead.pid}-x").mkdir()            # a killed run's folder
    (tmp / f"megarl-rpc-{os.getpid()}-y").mkdir()         # a live process's folder
    tmp, (path, env, mode) = _rpc(tmp_path, code="open(os.path.join(p, 'sock'), 'w').close()\n")
    assert os.path.basename(path).startswith("megarl-rpc-") and os.path.dirname(path) == str(tmp)
    assert env == path and mode == "0o700"
    assert not os.path.exists(path), "the folder outlived its process"
    assert sorted(p.name for p in tmp.iterdir()) == [f"megarl-rpc-{os.getpid()}-y"]


def test_a_users_rpc_path_is_kept_and_an_inherited_one_replaced(short_tmp):
    tmp_path = short_tmp
    user = tmp_path / "mine"
    user.mkdir()
    _, (path, env, _) = _rpc(tmp_path, {"VLLM_RPC_BASE_PATH": str(user)})
    assert path == env == str(user)
    inherited = tmp_path / f"megarl-rpc-{os.getpid()}-parent"
    inherited.mkdir()
    tmp, (path, env, _) = _rpc(tmp_path, {"VLLM_RPC_BASE_PATH": str(inherited)})
    assert path == env and os.path.dirname(path) == str(tmp) and path != str(inherited)


def test_no_private_folder_where_socket_paths_would_be_too_long(tmp_path):
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    _, (path, env, _) = _rpc(deep)
    assert path == env == "None"
    assert list((deep / "t").iterdir()) == []
