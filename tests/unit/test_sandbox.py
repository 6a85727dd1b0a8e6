"""The sandbox for model-written Python (megarl/envs/sandbox.py): what it lets through and what it
blocks. Every blocking test runs twice where user namespaces work: with them ("ns": the kernel
layer plus the audit hook) and without ("hook": the fallback, audit hook and rlimits only)."""
from __future__ import annotations

import asyncio
import glob
import os
import signal
import socket
import tempfile
import time

import pytest

from megarl.envs import sandbox
from megarl.envs.sandbox import SandboxLimits, run_python, run_python_sync

FAST = SandboxLimits(cpu_s=10, wall_s=20)   # generous: a loaded machine starts interpreters slowly


@pytest.fixture(params=["ns", "hook"])
def layers(request, monkeypatch):
    """Which layers are on: "ns" needs `unshare -rmn` here; "hook" turns the namespaces off."""
    if request.param == "ns" and not sandbox.namespaces_available():
        pytest.skip("user namespaces do not work on this machine")
    if request.param == "hook":
        monkeypatch.setattr(sandbox, "namespaces_available", lambda: False)
    return request.param


def test_plain_code_runs():
    """Ordinary code: output, the standard library, files in its own folder, exit status."""
    res = run_python_sync("print(2+3)", FAST)
    assert (res.stdout, res.exit_code, res.ok) == ("5\n", 0, True)
    res = run_python_sync("import math, fractions\nprint(math.comb(10, 3), fractions.Fraction(6, 4))", FAST)
    assert res.stdout == "120 3/2\n"
    res = run_python_sync("open('note.txt', 'w').write('kept')\nprint(open('note.txt').read())", FAST)
    assert res.stdout == "kept\n" and res.ok
    res = run_python_sync("import sys\nsys.exit(3)", FAST)
    assert res.exit_code == 3 and not res.killed


def test_traceback_names_the_script_line():
    res = run_python_sync("x = 1\ny = x / 0\n", FAST)
    assert res.exit_code == 1 and not res.timed_out
    assert 'main.py", line 2' in res.stderr
    assert res.stderr.strip().splitlines()[-1] == "ZeroDivisionError: division by zero"
    assert "<string>" not in res.stderr   # the sandbox's own wrapper frame is not shown


def test_write_outside_the_folder_is_blocked(layers, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    code = f"""
import os, shutil
tries = [
    lambda: open({str(tmp_path / 'escape.txt')!r}, 'w').write('x'),
    lambda: os.open({str(tmp_path / 'escape2.txt')!r}, os.O_WRONLY | os.O_CREAT),
    lambda: open('../../' + {str(tmp_path / 'escape3.txt')!r}.lstrip('/'), 'w'),
    lambda: (os.chdir({str(tmp_path)!r}), open('escape4.txt', 'w')),
    lambda: open({str(victim)!r}, 'a').write('changed'),
    lambda: os.remove({str(victim)!r}),
    lambda: os.rename({str(victim)!r}, 'stolen.txt'),
    lambda: os.mkdir({str(tmp_path / 'newdir')!r}),
    lambda: shutil.rmtree({str(tmp_path)!r}),
    lambda: os.symlink({str(tmp_path)!r}, 'link'),
]
for t in tries:
    try:
        t()
        print('WROTE')
    except OSError as err:
        print('refused', type(err).__name__)
"""
    res = run_python_sync(code, FAST)
    assert res.exit_code == 0, res.stderr
    assert "WROTE" not in res.stdout and res.stdout.count("refused") == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim.txt"]
    assert victim.read_text() == "original"


def test_network_is_blocked(layers):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.3)
    port = server.getsockname()[1]
    code = f"""
import socket
for t in (lambda: socket.create_connection(('127.0.0.1', {port}), timeout=1),
          lambda: socket.getaddrinfo('localhost', {port}),
          lambda: socket.socket().bind(('127.0.0.1', 0))):
    try:
        t()
        print('CONNECTED')
    except OSError as err:
        print('refused', flush=True)
"""
    try:
        res = run_python_sync(code, FAST)
        with pytest.raises(socket.timeout):
            server.accept()          # nothing connected
    finally:
        server.close()
    assert res.stdout.split() == ["refused"] * 3, res.stdout + res.stderr


def test_infinite_loop_is_killed_within_its_limits():
    """A busy loop ends at its CPU limit (SIGXCPU, or SIGKILL at the hard limit a second
    later), long before a 60 s wall clock; a sleeping loop, which uses no CPU, at the wall
    clock. No elapsed-time bound but the wall clock itself: the machine may be loaded."""
    t0 = time.monotonic()
    res = run_python_sync("while True:\n    pass\n", SandboxLimits(cpu_s=1, wall_s=60))
    assert res.timed_out and res.killed and res.exit_code in (-signal.SIGXCPU, -signal.SIGKILL)
    assert time.monotonic() - t0 < 60                         # the CPU limit, not the wall clock, ended it
    res = run_python_sync("import time\nwhile True:\n    time.sleep(0.1)\n", SandboxLimits(cpu_s=5, wall_s=1))
    assert res.timed_out and res.killed and res.exit_code == -signal.SIGKILL   # sleeping: the wall clock


def test_forks_and_spawns_are_refused(layers, tmp_path):
    """Every way to start another process is refused; had one started, its marker would appear
    after the run's timeout."""
    marker = str(tmp_path / "survivor")
    late = f"import time; time.sleep(1.5); open({marker!r}, 'w').write('alive')"
    code = f"""
import os, sys
def fork():
    if os.fork() == 0:
        exec({late!r})
tries = [fork, lambda: os.system('sleep 1.5; touch {marker}'),
         lambda: os.posix_spawn(sys.executable, [sys.executable, '-c', {late!r}], {{}}),
         lambda: os.execv(sys.executable, [sys.executable, '-c', {late!r}]),
         lambda: __import__('subprocess'), lambda: __import__('multiprocessing').Process().start(),
         lambda: __import__('ctypes')]
for t in tries:
    try:
        t()
        print('STARTED', flush=True)
    except (OSError, ImportError) as err:
        print('refused', flush=True)
"""
    # a wall clock that start-up on a loaded machine cannot reach: every try gets its answer
    res = run_python_sync(code, SandboxLimits(cpu_s=10, wall_s=30))
    assert res.stdout.split() == ["refused"] * 7, res.stdout + res.stderr
    time.sleep(2.0)   # a survivor would have written its marker 1.5 s after it started
    assert not os.path.exists(marker)


def test_the_whole_process_group_dies_at_the_timeout(monkeypatch, tmp_path):
    """The wall-clock kill covers every process of the run's group, not only the first one:
    a background child (started here by a plain shell instead of the sandboxed interpreter)
    must not write its marker after the timeout."""
    marker = tmp_path / "survivor"
    script = f"(sleep 1.5; touch {marker}) & echo $!; sleep 30"
    monkeypatch.setattr(sandbox, "child_argv", lambda folder, limits, isolate: ["/bin/sh", "-c", script])
    res = run_python_sync("", SandboxLimits(cpu_s=5, wall_s=0.5))
    assert res.timed_out
    background = int(res.stdout.split()[0])
    time.sleep(2.0)
    assert not marker.exists()
    try:   # gone, or a zombie waiting for its reaper: either way it runs no more
        with open(f"/proc/{background}/stat") as f:
            assert f.read().split(") ")[1][0] in "ZX"
    except FileNotFoundError:
        pass


def test_memory_limit():
    res = run_python_sync("x = bytearray(2 * 1024**3)\nprint('allocated')", SandboxLimits(memory_mb=256))
    assert "allocated" not in res.stdout
    assert res.exit_code != 0 and res.stderr.strip().splitlines()[-1] == "MemoryError"


def test_output_flood_is_cut_and_killed():
    res = run_python_sync("while True:\n    print('y' * 1000)\n", SandboxLimits(output_bytes=5000, wall_s=60))
    assert res.truncated and res.killed and not res.timed_out   # killed at the flood, not at the wall clock
    assert res.stdout == ("y" * 1000 + "\n") * 4 + "y" * 996   # exactly output_bytes kept


def test_environment_is_scrubbed(layers, monkeypatch):
    monkeypatch.setenv("MEGARL_TEST_SECRET", "hunter2-secret")
    code = "import os\nprint(sorted(os.environ))\nprint(open('/proc/self/environ', 'rb').read())"
    res = run_python_sync(code, FAST)
    assert res.ok, res.stderr
    assert "hunter2-secret" not in res.stdout and "MEGARL_TEST_SECRET" not in res.stdout
    names = set(eval(res.stdout.splitlines()[0])) - {"PWD", "OLDPWD"}   # the cwd, set by the shell
    assert names == {"HOME", "LANG", "PATH", "TMPDIR"}


def test_folder_is_private_and_removed_afterwards(layers):
    code = "import os, stat\nprint(os.getcwd())\nprint(oct(stat.S_IMODE(os.stat('.').st_mode)))\nprint(os.listdir('.'))"
    res = run_python_sync(code, FAST)
    folder, mode, listing = res.stdout.splitlines()
    assert os.path.basename(folder).startswith("megarl-sandbox-")
    assert mode == "0o700" and listing == "['main.py']"      # nothing but the script
    assert os.environ.get("HOME") != folder
    assert not os.path.exists(folder)
    res = run_python_sync("import os\nprint(os.getcwd(), flush=True)\nos.makedirs('a/b')\nwhile True: pass",
                          SandboxLimits(cpu_s=1, wall_s=3))
    assert res.timed_out and not os.path.exists(res.stdout.split()[0])   # also after a kill


def test_cancelling_a_run_kills_it_and_cleans_up():
    pattern = os.path.join(tempfile.gettempdir(), "megarl-sandbox-*")
    before = set(glob.glob(pattern))

    async def scenario():
        task = asyncio.ensure_future(run_python("import time\ntime.sleep(30)", SandboxLimits(wall_s=20)))
        await asyncio.sleep(0.5)
        started = set(glob.glob(pattern)) - before
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return started

    started = asyncio.run(scenario())
    assert len(started) == 1
    assert not any(os.path.exists(p) for p in started)


def test_limits_are_checked():
    with pytest.raises(ValueError, match="memory_mb=10 must be >= 64"):
        SandboxLimits(memory_mb=10)
    with pytest.raises(ValueError, match="wall_s=0"):
        SandboxLimits(wall_s=0)


def test_without_namespaces_one_loud_warning(monkeypatch, caplog):
    """No `unshare` here: the check says so once, with one warning, however often it is asked."""
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    sandbox.namespaces_available.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="megarl.envs.sandbox"):
            assert [sandbox.namespaces_available() for _ in range(3)] == [False] * 3
    finally:
        sandbox.namespaces_available.cache_clear()   # the next caller probes this machine again
    warnings = [r for r in caplog.records if r.name == "megarl.envs.sandbox"]
    assert len(warnings) == 1 and "SANDBOX WEAKER" in warnings[0].getMessage()
