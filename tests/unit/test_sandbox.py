"""The sandbox for model-written Python (megarl/envs/sandbox.py): ordinary code runs, and its
limits hold (CPU, wall clock, memory, output, the process group, the folder, the environment).
The escape routes, in every mode, are tests/unit/test_sandbox_escapes.py."""
from __future__ import annotations

import asyncio
import glob
import os
import signal
import socket
import tempfile
import time

import pytest
from sandbox_modes import FAST, MODES, force

from megarl.envs import sandbox
from megarl.envs.sandbox import SandboxLimits, run_python, run_python_sync


@pytest.fixture(autouse=True)
def limits_on_any_machine(monkeypatch):
    """The limits hold whatever kernel layers this machine has: where it lacks one (a run would
    be refused), these tests accept the weaker sandbox; the isolation tests skip there instead."""
    real = sandbox.available_layers()
    if sandbox.refusal(real):
        monkeypatch.setattr(sandbox, "require", lambda allow_weak=False: real)


@pytest.fixture(params=MODES)
def mode(request, monkeypatch):
    """The full sandbox, with and without namespaces (sandbox_modes.py)."""
    force(monkeypatch, request.param)
    return request.param


def test_plain_code_runs(mode):
    """Ordinary code: output, the standard library (C extensions and the shared libraries they
    load included), files in its own folder, temp files, exit status."""
    res = run_python_sync("print(2+3)", FAST)
    assert (res.stdout, res.exit_code, res.ok) == ("5\n", 0, True)
    code = """
import math, fractions, decimal, sqlite3, json, zlib, hashlib, tempfile, time, os, random, statistics
print(math.comb(10, 3), fractions.Fraction(6, 4), decimal.Decimal(1) / 8, time.localtime().tm_year > 2000)
db = sqlite3.connect("kept.db")
db.execute("create table t(x)")
db.execute("insert into t values (7)")
db.commit()
print(db.execute("select x from t").fetchone()[0], len(hashlib.sha256(zlib.compress(b"a")).hexdigest()))
with tempfile.NamedTemporaryFile("w", delete=False) as f:
    f.write("kept")
os.makedirs("a/b")
os.rename(f.name, "a/b/moved.txt")
print(open("a/b/moved.txt").read(), os.listdir("a/b"), os.path.dirname(f.name) == os.getcwd())
os.remove("a/b/moved.txt")
os.kill(os.getpid(), 0)   # signalling itself is allowed
"""
    res = run_python_sync(code, FAST)
    assert res.ok, res.stderr
    assert res.stdout == "120 3/2 0.125 True\n7 64\nkept ['moved.txt'] True\n"
    res = run_python_sync("import sys\nsys.exit(3)", FAST)
    assert res.exit_code == 3 and not res.killed


def test_traceback_names_the_script_line():
    res = run_python_sync("x = 1\ny = x / 0\n", FAST)
    assert res.exit_code == 1 and not res.timed_out
    assert 'main.py", line 2' in res.stderr
    assert res.stderr.strip().splitlines()[-1] == "ZeroDivisionError: division by zero"
    assert "<string>" not in res.stderr   # the sandbox's own prelude frames are not shown


def test_network_is_blocked(mode):
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


def test_forks_and_spawns_are_refused(mode, tmp_path):
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
    monkeypatch.setattr(sandbox, "child_argv", lambda folder, limits, layers: ["/bin/sh", "-c", script])
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


def test_environment_is_scrubbed(mode, monkeypatch):
    monkeypatch.setenv("MEGARL_TEST_SECRET", "hunter2-secret")
    code = """import os
print(sorted(os.environ))
try:
    print(open('/proc/self/environ', 'rb').read())
except OSError:
    print('refused')   # /proc is not among the readable roots
"""
    res = run_python_sync(code, FAST)
    assert res.ok, res.stderr
    assert "hunter2-secret" not in res.stdout and "MEGARL_TEST_SECRET" not in res.stdout
    names = set(eval(res.stdout.splitlines()[0])) - {"PWD", "OLDPWD"}   # the cwd, set by the shell
    assert names == {"HOME", "LANG", "PATH", "TMPDIR"}


def test_folder_is_private_and_removed_afterwards(mode):
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


def test_cancelling_a_run_kills_it_and_cleans_up(tmp_path, monkeypatch):
    # a temporary folder of this test's own: sandboxes of other tests running beside it (the
    # suite's other worker) must not count as this run's
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
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


# --- the seccomp filter, read by a small BPF interpreter (both ABIs, whatever this machine is) ---
