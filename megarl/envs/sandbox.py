"""Running model-written Python without a container runtime (docs/agents.md).

Each run is a fresh interpreter in layers, each covering what the others may miss:

* a private empty folder (`tempfile.mkdtemp`, mode 0700) as cwd, HOME and TMPDIR, the code
  written there as `main.py` (tracebacks name its lines), removed afterwards;
* `python -I -S -B` with a scrubbed environment: no variable of this process reaches the code
  (no tokens, no proxies), no site-packages (the standard library only), no bytecode writes;
* its own session and process group (`start_new_session`), killed as a whole (SIGKILL to the
  group) when the wall clock runs out, output passes `output_bytes`, or the call is cancelled;
  the clock starts before the interpreter does, so a slow start-up counts too;
* rlimits set before exec: CPU seconds, address space, file size, open files, no core files;
  the process count (RLIMIT_NPROC) is set by the child itself just before the code runs,
  because the namespace set-up below forks `mount`. The kernel does not apply RLIMIT_NPROC to
  the real root user: there only the audit hook below stops forks;
* where unprivileged user namespaces work (`unshare -rmn`): no network at all (an empty
  network namespace), and every mount read-only except the folder, so writes elsewhere fail
  in the kernel. Where they do not, one warning is logged and the other layers remain;
* an audit hook (`sys.addaudithook`, which Python code cannot remove) installed before the
  code runs: it refuses writes, removals, renames and new folders outside the folder,
  sockets' connect / bind / name lookups, subprocesses, exec, fork, spawn, symlinks and hard
  links, signals to other processes, ctypes (through which the hook could be undone) and the
  few imports that would hand back unhooked primitives.

The audit hook alone is not a security boundary against code crafted to escape (Python
objects can be tampered with in ways no hook sees); it stops the ordinary ways. The
namespace layer is what makes "no network, no writes outside" hold in the kernel.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache

log = logging.getLogger("megarl.envs.sandbox")

#: name of the script the code is written to inside the folder
SCRIPT_NAME = "main.py"
#: after the process group is killed, how long its pipes may take to close (seconds)
DRAIN_GRACE_S = 2.0
#: the chunk read from the child's pipes at a time
READ_CHUNK = 65536


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. Defaults fit a math tool call; env.timeout_s must exceed wall_s."""
    cpu_s: float = 3.0          # CPU seconds (RLIMIT_CPU; SIGXCPU then SIGKILL one second later)
    wall_s: float = 5.0         # wall-clock seconds from spawn to exit, start-up included
    memory_mb: int = 512        # address space (RLIMIT_AS), MiB
    output_bytes: int = 8192    # kept per stream (stdout, stderr); more kills the run
    file_mb: int = 16           # largest file the code may write (RLIMIT_FSIZE), MiB
    max_files: int = 64         # open file descriptors (RLIMIT_NOFILE)
    max_procs: int = 1          # processes and threads of this user (RLIMIT_NPROC; not applied to root)

    def __post_init__(self):
        checks = (
            ("cpu_s", self.cpu_s > 0, "must be > 0 seconds"),
            ("wall_s", self.wall_s > 0, "must be > 0 seconds"),
            # the interpreter itself maps ~30 MiB; below 64 it cannot start and every run fails
            ("memory_mb", self.memory_mb >= 64, "must be >= 64 MiB (the interpreter alone needs ~30)"),
            ("output_bytes", self.output_bytes >= 1, "must be >= 1"),
            ("file_mb", self.file_mb >= 1, "must be >= 1 MiB"),
            ("max_files", self.max_files >= 8, "must be >= 8 (stdin, stdout, stderr and the script)"),
            ("max_procs", self.max_procs >= 1, "must be >= 1"),
        )
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"sandbox {name}={getattr(self, name)!r} {why}")


@dataclass(frozen=True)
class SandboxResult:
    """What a run gave back. `exit_code` is negative when a signal ended it (-9: killed)."""
    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool = False     # the wall clock or the CPU limit ended it
    killed: bool = False        # a signal ended it (timeout, output flood, a limit)
    truncated: bool = False     # stdout or stderr passed output_bytes (what is kept is cut there)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not (self.timed_out or self.killed)


# --- the child: runs first in the sandboxed interpreter, then hands over to main.py -------------
# Passed with -c; argv: [folder, max_procs]. Everything the hook relies on is bound in the hook's
# closure at install time (posix functions, not os.path ones that the code could replace), and
# it never calls code of the sandboxed program except os.fspath on a path object.
_CHILD = r'''
import sys, resource, traceback, types
resource.setrlimit(resource.RLIMIT_NPROC, (int(sys.argv[2]),) * 2)

def _install(root):
    import posix
    getcwd, readlink, getpid, fspath = posix.getcwd, posix.readlink, posix.getpid, posix.fspath
    WRITE = posix.O_WRONLY | posix.O_RDWR | posix.O_CREAT | posix.O_TRUNC | posix.O_APPEND
    DENY = frozenset({"subprocess.Popen", "os.system", "os.fork", "os.forkpty", "os.symlink", "os.link",
                      "os.killpg", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
                      "cpython.PyInterpreterState_New"})
    PREFIX = ("socket.", "ctypes.", "os.exec", "os.spawn", "os.posix_spawn")
    NO_IMPORT = frozenset({"ctypes", "_ctypes", "_posixsubprocess", "_xxsubinterpreters", "_testcapi",
                           "_testinternalcapi", "posix", "_io", "builtins", "sys", "_imp"})
    # event -> (index of the path, index of its dir_fd or None), for events that change files
    PATHS = {"os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),), "os.chmod": ((0, 2),),
             "os.chown": ((0, 3),), "os.utime": ((0, 3),), "os.truncate": ((0, None),),
             "os.rename": ((0, 2), (1, 3)), "shutil.rmtree": ((0, 1),),
             "os.setxattr": ((0, None),), "os.removexattr": ((0, None),)}

    def where(path, dir_fd):
        """The absolute, lexically normalised path an event acts on (raises when it cannot
        tell). Lexical is enough: the folder starts empty and symlinks / hard links cannot be made."""
        if type(path) is int:
            path = readlink("/proc/self/fd/%d" % path)
        elif type(path) not in (str, bytes):
            path = fspath(path)
        if isinstance(path, bytes):
            path = bytes.decode(bytes(path), "utf-8", "surrogateescape")
        path = str.__str__(path)   # a str subclass cannot answer with methods of its own
        if not path.startswith("/"):
            # os.* events give dir_fd -1 (or AT_FDCWD) when none was passed: the cwd
            base = readlink("/proc/self/fd/%d" % dir_fd) if type(dir_fd) is int and dir_fd >= 0 else getcwd()
            path = base + "/" + path
        parts = []
        for part in path.split("/"):
            if part == "..":
                if parts:
                    parts.pop()
            elif part and part != ".":
                parts.append(part)
        return "/" + "/".join(parts)

    def inside(path, dir_fd=None):
        try:
            p = where(path, dir_fd)
        except Exception:
            return False
        return p == root or p.startswith(root + "/")

    def absolute(path):
        raw = path if type(path) in (str, bytes) else fspath(path)
        return raw[:1] in ("/", b"/")

    def refuse(what):
        raise PermissionError("sandbox: %s is not allowed" % what)

    def hook(event, args):
        if event in DENY or event.startswith(PREFIX):
            if event != "socket.__new__":   # creating a socket is harmless; using it is not
                refuse(event)
        elif event == "open":
            path, mode, flags = args
            if flags is not None and flags & WRITE and type(path) is not int:
                if mode is None and not absolute(path):
                    # os.open does not tell the hook its dir_fd: a relative path could be anywhere
                    refuse("os.open for writing with a relative path (give an absolute one)")
                if not inside(path):
                    refuse("writing %r outside the sandbox folder" % (path,))
        elif event in PATHS:
            for i, j in PATHS[event]:
                if not inside(args[i], None if j is None else args[j]):
                    refuse("%s on %r outside the sandbox folder" % (event, args[i]))
        elif event == "os.kill":
            if args[0] != getpid():
                refuse("signalling another process")
        elif event == "import":
            if args[0] in NO_IMPORT:
                refuse("importing %s" % args[0])
        elif event == "object.__setattr__":
            if args[0] is hook:
                refuse("changing the sandbox's hook")

    sys.addaudithook(hook)

_install(sys.argv[1])
del _install
_path = sys.argv[1] + "/main.py"
sys.argv = [_path]
sys.path.insert(0, _path.rsplit("/", 1)[0])   # modules the code writes itself
try:
    with open(_path, "rb") as _f:
        _code = compile(_f.read(), _path, "exec")
    # a clean __main__ of its own (pickle and `import __main__` find the code's names there)
    _main = sys.modules["__main__"] = types.ModuleType("__main__")
    _main.__file__ = _path
    exec(_code, _main.__dict__)
except SystemExit:
    raise
except BaseException as _err:
    # drop this wrapper's own frame: the traceback starts in main.py
    traceback.print_exception(type(_err), _err, _err.__traceback__.tb_next)
    sys.exit(1)
'''

# Runs inside the new namespaces before the interpreter: the folder becomes a mount of its own,
# then every mount is made read-only (all but the folder's own). A mount the kernel will not
# remount (some pseudo file systems) is left as it is; argv: [folder, command...]
_NAMESPACE_SETUP = r'''
d="$1"; shift
mount --bind "$d" "$d" || exit 97
cd "$d" || exit 97   # the cwd inherited from the spawn still points below the new mount
while read -r _ _ _ _ mp _; do
  mp=$(printf '%b' "$mp")
  [ "$mp" = "$d" ] || mount -o remount,bind,ro "$mp" 2>/dev/null || true
done < /proc/self/mountinfo
exec "$@"
'''


@lru_cache(maxsize=1)
def namespaces_available() -> bool:
    """Whether `unshare -rmn` (user, mount and network namespaces) with the read-only set-up
    works here; tried once, on a folder of its own. When it does not, logs ONE warning: the
    sandbox then has network and a writable file system below the audit hook."""
    unshare = shutil.which("unshare")
    ok = False
    if unshare:
        folder = os.path.realpath(tempfile.mkdtemp(prefix="megarl-sandbox-probe-"))
        try:
            argv = [unshare, "-rmn", "/bin/sh", "-c", _NAMESPACE_SETUP, "sandbox", folder, "/bin/sh", "-c",
                    f"touch probe && ! touch '{folder}-outside' 2>/dev/null"]
            ok = subprocess.run(argv, cwd=folder, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, timeout=10).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        finally:
            _remove_folder(folder)
            if os.path.exists(folder + "-outside"):   # the set-up did not make the rest read-only
                os.remove(folder + "-outside")
    if not ok:
        log.warning("SANDBOX WEAKER: `unshare -rmn` does not work here (%s), so model-written code runs "
                    "WITH network access and a writable file system, held back only by the audit hook "
                    "and rlimits. Enable unprivileged user namespaces (sysctl "
                    "kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0) for the stronger layer.",
                    "no unshare binary" if not unshare else "it failed")
    return ok


def child_env(folder: str) -> dict:
    """The child's whole environment: nothing of this process's (no secrets travel)."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8"}


def child_argv(folder: str, limits: SandboxLimits, isolate: bool) -> list[str]:
    """The command line: the interpreter with the child prelude, inside namespaces if `isolate`."""
    python = [sys.executable, "-I", "-S", "-B", "-c", _CHILD, folder, str(limits.max_procs)]
    if not isolate:
        return python
    return [shutil.which("unshare") or "unshare", "-rmn", "/bin/sh", "-c", _NAMESPACE_SETUP, "sandbox", folder,
            *python]


def rlimits(limits: SandboxLimits) -> list[tuple[int, tuple[int, int]]]:
    """(resource, (soft, hard)) pairs applied before exec. CPU: SIGXCPU at the limit, SIGKILL a
    second later (code that ignores SIGXCPU still ends)."""
    cpu = max(1, math.ceil(limits.cpu_s))
    mem = limits.memory_mb * 1024 * 1024
    fsize = limits.file_mb * 1024 * 1024
    return [(resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (mem, mem)),
            (resource.RLIMIT_FSIZE, (fsize, fsize)), (resource.RLIMIT_NOFILE, (limits.max_files,) * 2),
            (resource.RLIMIT_CORE, (0, 0))]


def _preexec(pairs):
    # runs between fork and exec: only setrlimit calls on values computed beforehand (no imports,
    # no locks), which keeps it safe in a process with other threads
    def apply():
        for res, value in pairs:
            resource.setrlimit(res, value)
    return apply


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass   # already gone


def _remove_folder(folder: str) -> None:
    """Remove the folder even where the code took away its own permissions on parts of it."""
    def unlock(func, path, _exc):
        try:
            os.chmod(os.path.dirname(path), stat.S_IRWXU)
            if os.path.isdir(path) and not os.path.islink(path):
                os.chmod(path, stat.S_IRWXU)
            func(path)
        except OSError:
            pass
    shutil.rmtree(folder, onerror=unlock)


async def _drain(stream: asyncio.StreamReader, cap: int, on_overflow) -> tuple[bytes, bool]:
    """Read `stream` to EOF keeping at most `cap` bytes; past it call on_overflow and stop."""
    kept = bytearray()
    while True:
        chunk = await stream.read(READ_CHUNK)
        if not chunk:
            return bytes(kept), False
        if len(kept) + len(chunk) > cap:
            kept += chunk[:cap - len(kept)]
            on_overflow()
            while await stream.read(READ_CHUNK):   # to EOF (the kill brings it): the pipe then closes
                pass
            return bytes(kept), True
        kept += chunk


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


async def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as a script in a fresh sandboxed interpreter (see the module docstring) and
    return its output. Never raises for what the code does; raises OSError only when the
    interpreter cannot be started at all. Cancelling the call kills the run and cleans up."""
    limits = limits or SandboxLimits()
    isolate = namespaces_available()
    folder = os.path.realpath(tempfile.mkdtemp(prefix="megarl-sandbox-"))
    proc = None
    readers: list[asyncio.Future] = []
    try:
        with open(os.path.join(folder, SCRIPT_NAME), "w", encoding="utf-8") as f:
            f.write(code)
        proc = await asyncio.create_subprocess_exec(
            *child_argv(folder, limits, isolate), cwd=folder, env=child_env(folder),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True, preexec_fn=_preexec(rlimits(limits)))
        sent_kill = False

        def kill():
            nonlocal sent_kill
            sent_kill = True
            _kill_group(proc.pid)

        readers = [asyncio.ensure_future(_drain(s, limits.output_bytes, kill)) for s in (proc.stdout, proc.stderr)]
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), limits.wall_s)
        except asyncio.TimeoutError:
            timed_out = True
            kill()
            await proc.wait()
        # what the code left behind in its group (a daemon, a sleeping child) ends with it
        _kill_group(proc.pid)
        done, pending = await asyncio.wait(readers, timeout=DRAIN_GRACE_S)
        (out, cut_out), (err, cut_err) = [t.result() if t in done else (b"", True) for t in readers]
        rc = proc.returncode
        cpu_limit = rc == -signal.SIGXCPU or (rc == -signal.SIGKILL and not sent_kill)
        return SandboxResult(stdout=_decode(out), stderr=_decode(err), exit_code=rc,
                             timed_out=timed_out or cpu_limit, killed=rc < 0, truncated=cut_out or cut_err)
    finally:
        if proc is not None and proc.returncode is None:   # cancelled mid-run
            _kill_group(proc.pid)
            # reap it (and let its pipes close) before the folder goes; SIGKILL makes this quick
            await asyncio.wait([asyncio.ensure_future(proc.wait()), *readers], timeout=DRAIN_GRACE_S)
        for task in readers:
            task.cancel()
        _remove_folder(folder)


def run_python_sync(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """`run_python` for callers without an event loop (scripts, tests). Inside a running loop,
    await run_python instead (asyncio.run refuses to nest)."""
    return asyncio.run(run_python(code, limits))
