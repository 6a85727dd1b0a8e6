"""Escapes from the sandbox (megarl/envs/sandbox.py), each route tried in every mode this machine
can give (tests/unit/sandbox_modes.py), with and without the audit hook: writes outside the
folder, reads of the run's secrets and of other processes, sockets of any kind, processes.
A machine without Landlock or seccomp skips those; what it does instead (refuse, unless weaker
is accepted) is tested on every machine by forcing the layers off. The seccomp filter is also
read instruction by instruction, for each ABI it knows, whatever this machine is."""
from __future__ import annotations

import glob
import os
import re
import socket
import subprocess
import time
import uuid

import pytest
from sandbox_modes import FAST, KERNEL_MODES, bpf, force

from megarl.envs import sandbox, sandbox_kernel
from megarl.envs.sandbox import SandboxLayers, SandboxUnavailable, run_python_sync
from megarl.envs.tool_math import PythonToolEnv


@pytest.fixture(params=KERNEL_MODES)
def kmode(request, monkeypatch):
    """Each mode, with and without the audit hook (sandbox_modes.py)."""
    force(monkeypatch, request.param)
    return request.param


def _lines(res) -> dict:
    """{try name: "refused" | "DONE"} from a script printing "name verdict" lines."""
    out = dict(line.split()[:2] for line in res.stdout.splitlines() if line.strip())
    assert out, f"the script printed nothing: {res.stderr}"
    return out


# every escape script uses this helper: a try that raises is refused, one that returns is DONE
TRY = """
import errno, os, sqlite3
try:
    import ctypes
    LIBC = ctypes.CDLL(None, use_errno=True)
except (ImportError, PermissionError):   # the audit hook refuses ctypes: those tries are too
    LIBC = None
def t(name, f):
    try:
        f()
        print(name, "DONE", flush=True)
    except (OSError, sqlite3.Error, ImportError) as err:
        print(name, "refused", type(err).__name__, flush=True)
def libc():
    if LIBC is None:
        raise ImportError("ctypes is refused")
    return LIBC
def c(result):   # a libc call's result: -1 is its error
    if result == -1:
        raise OSError(ctypes.get_errno(), "libc")
    return result
"""


def test_no_write_outside_the_folder(kmode, tmp_path):
    """Every route to the file system outside the folder, by Python's own functions, sqlite's own
    file I/O, FIFOs and device nodes, open flags, links, renames, metadata, ctypes and mount."""
    out = tmp_path / "out"
    out.mkdir()
    victim = out / "victim.txt"
    victim.write_text("original")
    os.chmod(victim, 0o640)
    before = os.stat(victim)
    shm = f"/dev/shm/megarl-test-{uuid.uuid4().hex}"
    code = TRY + f"""
import shutil, stat
OUT, SHM, VICTIM = {str(out)!r}, {shm!r}, {str(victim)!r}
open("mine.txt", "w").write("inside")
os.mkdir("sub")
tries = {{
    "sqlite-connect": lambda: sqlite3.connect(OUT + "/a.db").execute("create table t(x)"),
    "sqlite-uri": lambda: sqlite3.connect("file:" + OUT + "/u.db?mode=rwc", uri=True).execute("create table t(x)"),
    "sqlite-attach": lambda: sqlite3.connect("in.db").execute("attach database ? as x", (OUT + "/b.db",))
                                                      .execute("create table x.t(a)"),
    "sqlite-vacuum-into": lambda: sqlite3.connect("in2.db").execute("vacuum into ?", (OUT + "/c.db",)),
    "mkfifo-tmp": lambda: os.mkfifo(OUT + "/fifo"),
    "mkfifo-shm": lambda: os.mkfifo(SHM + "-fifo"),
    "mknod": lambda: os.mknod(OUT + "/node", 0o600 | stat.S_IFREG),
    "mkfifo-inside-then-move": lambda: (os.mkfifo("f"), os.rename("f", OUT + "/f")),
    "open-creat": lambda: os.open(OUT + "/d", os.O_WRONLY | os.O_CREAT, 0o644),
    "open-excl-shm": lambda: os.open(SHM, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600),
    "open-append": lambda: os.write(os.open(VICTIM, os.O_WRONLY | os.O_APPEND), b"x"),
    "open-rdwr": lambda: os.write(os.open(VICTIM, os.O_RDWR), b"x"),
    "open-trunc": lambda: os.open(VICTIM, os.O_RDONLY | os.O_TRUNC),
    "open-tmpfile": lambda: os.open(OUT, os.O_TMPFILE | os.O_WRONLY, 0o600),
    "open-dir-fd": lambda: os.open("e", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=os.open(OUT, os.O_PATH)),
    "builtin-open": lambda: open(OUT + "/g", "x").write("x"),
    "builtin-append": lambda: open(VICTIM, "a").write("changed"),
    "relative-dotdot": lambda: open("../" * 8 + OUT.lstrip("/") + "/dotdot", "w").write("x"),
    "chdir-then-relative": lambda: (os.chdir(OUT), open("relative", "w").write("x")),
    "link-in": lambda: os.link(VICTIM, "hard"),
    "link-out": lambda: os.link("mine.txt", OUT + "/hard"),
    "rename-in": lambda: os.rename(VICTIM, "stolen"),
    "rename-out": lambda: os.rename("mine.txt", OUT + "/moved"),
    "replace-over": lambda: os.replace("mine.txt", VICTIM),
    "move-dir-out": lambda: shutil.move("sub", OUT + "/sub"),
    "symlink-in": lambda: os.symlink(VICTIM, "link"),
    "symlink-out": lambda: os.symlink("/etc", OUT + "/link"),
    "chmod": lambda: os.chmod(VICTIM, 0o777),
    "utime": lambda: os.utime(VICTIM, (0, 0)),
    "truncate": lambda: os.truncate(VICTIM, 0),
    "remove": lambda: os.remove(VICTIM),
    "mkdir": lambda: os.mkdir(OUT + "/newdir"),
    "rmtree": lambda: shutil.rmtree(OUT),
    "ctypes-open": lambda: c(libc().open((OUT + "/h").encode(), os.O_WRONLY | os.O_CREAT, 0o644)),
    "ctypes-remount-rw": lambda: (c(libc().mount(None, OUT.encode(), None, 4096 | 32, None)),
                                  open(OUT + "/after-remount", "w").write("x")),
}}
for name, f in tries.items():
    t(name, f)
"""
    res = run_python_sync(code, FAST)
    assert res.exit_code == 0, res.stderr
    verdicts = _lines(res)
    assert len(verdicts) == 35 and [n for n, v in verdicts.items() if v != "refused"] == [], res.stdout
    assert [p.name for p in out.iterdir()] == ["victim.txt"] and victim.read_text() == "original"
    after = os.stat(victim)
    assert (after.st_mode, after.st_mtime_ns, after.st_nlink) == (before.st_mode, before.st_mtime_ns, 1)
    assert glob.glob(shm + "*") == []


def test_no_read_of_secrets_or_other_processes(kmode, tmp_path):
    """The run's secrets stay unread: a key file the user can read (service.json), the parent's
    environment through /proc (the scrubbed environment would mean nothing otherwise), other
    processes' memory, the folders beside the sandbox's."""
    secret = tmp_path / "service.json"
    secret.write_text('{"api_key": "sk-test-secret"}')
    os.chmod(secret, 0o600)
    me = os.getpid()   # the sandboxed interpreter's parent (unshare and its shell exec into it)
    code = TRY + f"""
SECRET, PARENT = {str(secret)!r}, {me}
for name, path in [("secret", SECRET), ("parent-environ", "/proc/%d/environ" % os.getppid()),
                   ("named-parent-environ", "/proc/%d/environ" % PARENT),
                   ("parent-task-environ", "/proc/%d/task/%d/environ" % (PARENT, PARENT)),
                   ("parent-mem", "/proc/%d/mem" % PARENT), ("parent-cmdline", "/proc/%d/cmdline" % PARENT),
                   ("init-environ", "/proc/1/environ")]:
    t(name, lambda: open(path, "rb").read())
t("list-beside", lambda: os.listdir(os.path.dirname(SECRET)))
t("list-tmp", lambda: os.listdir(os.path.dirname(os.getcwd())))
t("ctypes-read", lambda: c(libc().open(SECRET.encode(), os.O_RDONLY)))
"""
    res = run_python_sync(code, FAST)
    assert res.exit_code == 0, res.stderr
    verdicts = _lines(res)
    assert len(verdicts) == 10 and [n for n, v in verdicts.items() if v != "refused"] == [], res.stdout
    assert "sk-test-secret" not in res.stdout + res.stderr


@pytest.fixture
def listeners(tmp_path):
    """A Unix-domain socket file, an abstract socket, a TCP and a UDP socket on loopback, all
    listening here; yields their addresses and a function naming those something reached."""
    made = {"unix": socket.socket(socket.AF_UNIX), "abstract": socket.socket(socket.AF_UNIX),
            "tcp": socket.socket(), "udp": socket.socket(socket.AF_INET, socket.SOCK_DGRAM)}
    made["unix"].bind(str(tmp_path / "rpc.sock"))
    made["abstract"].bind(f"\0megarl-test-{uuid.uuid4().hex}")
    made["tcp"].bind(("127.0.0.1", 0))
    made["udp"].bind(("127.0.0.1", 0))
    for name in ("unix", "abstract", "tcp"):
        made[name].listen(4)
    os.chmod(tmp_path / "rpc.sock", 0o777)
    for s in made.values():
        s.setblocking(False)

    def reached() -> list[str]:
        got = []
        for name, s in made.items():
            try:
                s.recv(1) if name == "udp" else s.accept()
                got.append(name)
            except BlockingIOError:
                pass
        return got

    yield {name: s.getsockname() for name, s in made.items()}, reached
    for s in made.values():
        s.close()


def test_no_socket_of_any_kind(kmode, listeners):
    """No connection to a same-user Unix-domain socket file (vLLM's RPC sockets), an abstract
    socket, or the network, whichever way the socket is made."""
    addresses, reached = listeners
    code = TRY + f"""
import socket
A = {addresses!r}
t("unix", lambda: socket.socket(socket.AF_UNIX).connect(A["unix"]))
t("unix-dgram", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b"x", A["unix"]))
t("abstract", lambda: socket.socket(socket.AF_UNIX).connect(A["abstract"]))
t("tcp", lambda: socket.create_connection(A["tcp"], timeout=2))
t("udp", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", A["udp"]))
t("tcp6", lambda: socket.socket(socket.AF_INET6).connect(("::1", A["tcp"][1])))
t("netlink", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0))
t("ctypes-socket", lambda: c(libc().socket(socket.AF_UNIX, socket.SOCK_STREAM, 0)))
"""
    res = run_python_sync(code, FAST)
    assert res.exit_code == 0, res.stderr
    verdicts = _lines(res)
    assert len(verdicts) == 8 and [n for n, v in verdicts.items() if v != "refused"] == [], res.stdout
    assert reached() == []


def test_no_process_started_or_signalled(kmode, tmp_path):
    """No fork (nothing would outlive the run), exec, new session or group (killpg would miss
    it), and no signal to another process: only to itself."""
    marker = str(tmp_path / "survivor")
    code = TRY + f"""
import signal, sys, time
MARKER, PARENT = {marker!r}, {os.getpid()}
def fork():
    if os.fork() == 0:
        time.sleep(1.5)
        open(MARKER, "w").write("alive")
        os._exit(0)
t("fork", fork)
t("exec", lambda: os.execv("/bin/sh", ["sh", "-c", "touch " + MARKER]))
t("spawn", lambda: os.posix_spawn("/bin/sh", ["sh", "-c", "touch " + MARKER], {{}}))
t("setsid", os.setsid)
t("setpgid", lambda: os.setpgid(0, 0))
t("kill-parent", lambda: os.kill(PARENT, 0))
t("kill-all", lambda: os.kill(-1, 0))
t("ctypes-kill-parent", lambda: c(libc().kill(PARENT, 0)))
got = []
signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
signal.raise_signal(signal.SIGUSR1)
print("self-signal", "ok" if got else "LOST")
"""
    res = run_python_sync(code, FAST)
    assert res.exit_code == 0, res.stderr
    verdicts = _lines(res)
    assert verdicts.pop("self-signal") == "ok"
    assert len(verdicts) == 8 and [n for n, v in verdicts.items() if v != "refused"] == [], res.stdout
    time.sleep(2.0)   # a survivor would have written its marker 1.5 s after it started
    assert not os.path.exists(marker)


def _weak(monkeypatch, **off) -> SandboxLayers:
    """Force a machine without some kernel layers (off: landlock / seccomp / capabilities /
    namespaces=True)."""
    why = tuple((layer, "switched off by the test") for layer in off)
    layers = SandboxLayers(namespaces="namespaces" not in off, landlock_abi=0 if "landlock" in off else 1,
                           seccomp="seccomp" not in off, capabilities="capabilities" not in off, why_not=why)
    monkeypatch.setattr(sandbox, "available_layers", lambda: layers)
    return layers


@pytest.mark.parametrize("off, missing", [({"landlock": 1}, ["reads"]),
                                          ({"seccomp": 1}, ["writes", "sockets", "processes"]),
                                          ({"landlock": 1, "namespaces": 1}, ["writes", "reads"]),
                                          ({"capabilities": 1, "namespaces": 1}, ["privileges"])])
def test_a_machine_without_a_kernel_layer_is_refused_by_default(monkeypatch, off, missing):
    """What the layers here cannot guarantee is refused, with one line naming what is missing,
    why, and the setting that accepts it; nothing runs until it is accepted."""
    layers = _weak(monkeypatch, **off)
    assert layers.missing() == missing
    with pytest.raises(SandboxUnavailable) as err:
        run_python_sync("print('ran')", FAST)
    line = str(err.value)
    assert "\n" not in line and sandbox.ALLOW_WEAK_SETTING in line and "switched off by the test" in line
    for guarantee in missing:
        assert sandbox.GUARANTEES[guarantee][0] in line
    with pytest.raises(ValueError, match=re.escape(sandbox.ALLOW_WEAK_SETTING)):
        PythonToolEnv(seed=0)   # refused when the environment is made (the run's preflight makes one)


def test_weaker_runs_once_accepted(monkeypatch, caplog):
    """Accepted, the weaker sandbox runs with one loud warning, however often it is asked."""
    _weak(monkeypatch, landlock=1, seccomp=1)
    sandbox._warn_weak.cache_clear()   # a test before may have warned with this very line
    with caplog.at_level("WARNING", logger="megarl.envs.sandbox"):
        res = run_python_sync("print('ran')", FAST, allow_weak=True)
        assert [sandbox.require(allow_weak=True).seccomp for _ in range(3)] == [False] * 3
    assert res.stdout == "ran\n"
    warnings = [r.getMessage() for r in caplog.records if r.name == "megarl.envs.sandbox" and r.levelname == "WARNING"]
    assert len(warnings) == 1 and sandbox.ALLOW_WEAK_SETTING in warnings[0], warnings
    for guarantee in ("writes", "reads", "sockets", "processes"):
        assert sandbox.GUARANTEES[guarantee][0] in warnings[0]
    assert PythonToolEnv(seed=0, allow_weak_sandbox=True).allow_weak_sandbox is True


def test_a_layer_that_cannot_be_applied_fails_closed(monkeypatch):
    """The kernel refuses the Landlock rules (an unknown right): the code does not run and the
    call raises, instead of running with less than it was promised."""
    real = sandbox.available_layers()
    if not real.landlock_abi:
        pytest.skip("no Landlock on this machine")
    bad = sandbox_kernel.LandlockPlan(abi=real.landlock_abi, handled_fs=1 << 60, handled_net=0, scoped=0, rules=())
    monkeypatch.setattr(sandbox_kernel, "landlock_plan", lambda folder, abi: bad)
    with pytest.raises(SandboxUnavailable, match="could not be applied"):
        run_python_sync("print('ran')", FAST)


def test_the_probe_names_what_this_machine_lacks(monkeypatch):
    """Each layer missing here is named with its reason, and the machine is probed once."""
    monkeypatch.setattr(sandbox_kernel, "landlock_abi", lambda: 0)
    monkeypatch.setattr(sandbox_kernel, "seccomp_supported", lambda: "no system call table for sparc64")
    monkeypatch.setattr(sandbox_kernel, "capabilities_supported", lambda: "not Linux (sunos5)")
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)   # no `unshare`
    sandbox.available_layers.cache_clear()
    sandbox.namespaces_available.cache_clear()
    try:
        layers = sandbox.available_layers()
        assert all(sandbox.available_layers() is layers for _ in range(3))
    finally:
        sandbox.available_layers.cache_clear()   # the next caller probes this machine again
        sandbox.namespaces_available.cache_clear()
    assert (layers.namespaces, layers.landlock_abi, layers.seccomp, layers.capabilities) == (False, 0, False, False)
    assert [layer for layer, _ in layers.why_not] == ["seccomp", "landlock", "capabilities", "namespaces"]
    assert layers.missing() == list(sandbox.GUARANTEES)
    assert "sparc64" in sandbox.refusal(layers) and "lsm=" in sandbox.refusal(layers)


def test_a_namespace_set_up_that_fails_stops_the_run(monkeypatch, tmp_path):
    """The folder's own mount cannot be made (a `mount` that refuses): the call raises, as for
    any layer, instead of handing the model a failed run as if its code had failed."""
    force(monkeypatch, "ns")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "mount").write_text("#!/bin/sh\necho 'mount: permission denied' >&2\nexit 32\n")
    os.chmod(fake / "mount", 0o755)
    real_env = sandbox.child_env
    monkeypatch.setattr(sandbox, "child_env", lambda folder: {**real_env(folder),
                                                             "PATH": f"{fake}:{real_env(folder)['PATH']}"})
    with pytest.raises(SandboxUnavailable, match="namespaces: .*permission denied"):
        run_python_sync("print('ran')", FAST)


@pytest.fixture
def fresh_probe():
    """available_layers probes this machine again in the test, and again after it."""
    sandbox.available_layers.cache_clear()
    yield
    sandbox.available_layers.cache_clear()


def test_a_layer_the_kernel_refuses_counts_as_absent(monkeypatch, fresh_probe):
    """The probe's child reports that Landlock could not be applied (as under a container's own
    profile): the layer is absent, with the kernel's reason, and the run is refused."""
    if not sandbox_kernel.landlock_abi():
        pytest.skip("no Landlock on this machine")
    bad = sandbox_kernel.LandlockPlan(abi=1, handled_fs=1 << 60, handled_net=0, scoped=0, rules=())
    monkeypatch.setattr(sandbox_kernel, "landlock_plan", lambda folder, abi: bad)
    layers = sandbox.available_layers()
    assert layers.landlock_abi == 0 and "reads" in layers.missing()
    assert [why for layer, why in layers.why_not if layer == "landlock"][0].startswith(sandbox.LAYER_FAILED_TEXT)


@pytest.mark.parametrize("error", [subprocess.TimeoutExpired("python", 30), OSError(11, "fork failed")])
def test_a_probe_that_cannot_tell_stops_the_run(monkeypatch, fresh_probe, error):
    """A probe that hangs or cannot start says nothing about the kernel: no layer is taken as
    absent on its word (accepted-weaker runs would go on without it for the process's life);
    the call raises, naming the probe, and the next one probes again."""
    if sandbox_kernel.seccomp_supported() and not sandbox_kernel.landlock_abi():
        pytest.skip("no kernel layer to probe on this machine")
    real = sandbox.available_layers()
    sandbox.available_layers.cache_clear()

    def broken(*args, **kwargs):
        raise error
    monkeypatch.setattr(sandbox.subprocess, "run", broken)
    with pytest.raises(SandboxUnavailable, match="probe"):
        run_python_sync("print('ran')", FAST, allow_weak=True)
    monkeypatch.undo()
    assert sandbox.available_layers() == real   # not cached: probed again, whole


# --- the seccomp filter, read by a small BPF interpreter (sandbox_modes.bpf), for each ABI ---
@pytest.mark.parametrize("machine", sorted(sandbox_kernel.ABIS))
def test_the_seccomp_filter_answers(machine):
    arch, nrs, foreign = sandbox_kernel.ABIS[machine]
    prog = sandbox_kernel.seccomp_program(machine)
    allow, eperm = sandbox_kernel.RET_ALLOW, sandbox_kernel.RET_EPERM
    assert len(prog) < 4096 and all(jt < 256 and jf < 256 for _, jt, jf, _ in prog)
    read = {"x86_64": 0, "aarch64": 63}[machine]
    assert bpf(prog, arch, read) == allow
    for name in ("socket", "mknodat", "linkat", "symlinkat", "mount", "unshare", "execve", "setsid", "ptrace",
                 "io_uring_setup", "fchmodat", "utimensat", "pidfd_send_signal"):
        assert bpf(prog, arch, nrs[name]) == eperm, name
    assert bpf(prog, arch, nrs["clone"], arg0=0x11) == eperm                            # fork's clone
    assert bpf(prog, arch, nrs["clone"], arg0=sandbox_kernel.CLONE_THREAD | 0x3d0f00) == allow   # a thread
    assert bpf(prog, arch, nrs["clone3"]) == sandbox_kernel.RET_ENOSYS
    for name in ("kill", "tgkill", "rt_sigqueueinfo"):
        assert bpf(prog, arch, nrs[name], arg0=4242) == allow                            # itself
        assert [bpf(prog, arch, nrs[name], arg0=a) for a in (1, 4241, -1, 0)] == [eperm] * 4
    assert [bpf(prog, arch, nrs["prlimit64"], arg0=a) for a in (0, 4242, 1)] == [allow, allow, eperm]
    assert bpf(prog, 0x40000003, read) == sandbox_kernel.RET_KILL                        # a 32-bit call
    if foreign is not None:
        assert bpf(prog, arch, foreign + read) == sandbox_kernel.RET_KILL                # x32


def _header_numbers(path: str) -> dict:
    with open(path) as f:
        return {m[0]: int(m[1]) for m in re.findall(r"#define __NR(?:3264)?_(\w+)\s+(\d+)\b", f.read())}


@pytest.mark.parametrize("machine, header", [("x86_64", "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
                                             ("aarch64", "/usr/include/asm-generic/unistd.h")])
def test_the_system_call_numbers_match_the_kernel_headers(machine, header):
    """A typo in a table would leave a call open: each number agrees with the kernel's own header
    where this machine has it (a header older than a call does not list it)."""
    if not os.path.exists(header):
        pytest.skip(f"{header} is not installed here")
    known = _header_numbers(header)
    table = sandbox_kernel.ABIS[machine][1]
    wrong = {name: (nr, known[name]) for name, nr in table.items() if name in known and known[name] != nr}
    assert wrong == {} and len(set(table) & set(known)) > 50
    names = set(sandbox_kernel._DENY) | set(sandbox_kernel._SELF_ONLY)
    assert names - set(sandbox_kernel.ABIS["x86_64"][1]) - set(sandbox_kernel.ABIS["aarch64"][1]) == set()
