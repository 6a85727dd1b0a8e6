"""Running model-written Python without a container runtime (docs/agents.md).

Each run is a fresh interpreter in layers, each covering what the others may miss:

* a private empty folder (`tempfile.mkdtemp`, mode 0700) as cwd, HOME and TMPDIR, the code
  written there as `main.py` (tracebacks name its lines), removed afterwards;
* `python -I -S -B` with a scrubbed environment: no variable of this process reaches the code
  (no tokens, no proxies), no site-packages (the standard library only), no bytecode writes;
* its own session and process group (`start_new_session`), killed as a whole (SIGKILL to the
  group) when the wall clock runs out, output passes `output_bytes`, or the call is cancelled.
  A session of its own on purpose, unlike megarl's vLLM servers (rollout/engines/servers.py): no
  terminal and no signal to the trainer's session reaches the model's code, and where the
  kernel groups scheduling by session, model code that spins competes as one group instead of
  taking the trainer's share of the CPU;
  the clock starts before the interpreter does, so a slow start-up counts too;
* rlimits set before exec: CPU seconds, address space, file size, open files, no core files;
  the process count (RLIMIT_NPROC) is set by the child itself just before the code runs;
* the kernel layers (sandbox_kernel.py), applied by the child prelude (sandbox_child.py) before
  the code runs, which nothing the code does can lift: no capability (every one dropped, the
  bounding set cleared where the child may, no_new_privs; as root it would otherwise keep the
  trainer's), Landlock (reads only beneath the interpreter's own prefix and the system library
  folders, writes only in the folder, no exec) and a seccomp filter (no socket of any kind, no
  FIFO / device / link / symlink, no change of mode, owner, times or attributes, no mount or
  namespace, no fork / exec / new session, no signal, trace or limit on another process, no
  io_uring, no privileged call: reboot, kexec, modules, the clock, swap, host name...). A layer
  that cannot be applied ends the run before the code starts (SandboxUnavailable);
* where unprivileged user namespaces work (`unshare -rmn`), also an empty network namespace
  and every mount read-only but the folder;
* an audit hook (`sys.addaudithook`) that refuses the ordinary ways out with a message saying
  why: writes outside the folder (sqlite's databases included), sockets, subprocesses, exec,
  fork, links, signals to others, ctypes. It is not a boundary (native code, an extension the
  code writes and imports, passes it); the kernel layers are.

What the modes guarantee, measured by tests/unit/test_sandbox_escapes.py and
test_sandbox_privileges.py (each route tried in each mode, with and without the audit hook):

guarantee (GUARANTEES' keys)         held by, namespaces on           held by, namespaces off
writes: nothing outside the folder   seccomp + Landlock / ro mounts   seccomp + Landlock
reads: only the interpreter's        Landlock                         Landlock
  library and the folder (no
  secrets, no /proc of others)
sockets: none (network, Unix-domain  seccomp (and the empty netns)    seccomp (and Landlock's
  socket files, abstract)                                               scopes from ABI 6)
processes: none started, signalled,  seccomp                          seccomp
  traced or re-limited
privileges: no capability over the   the namespace's own only (and    the drop, checked by the
  machine (reboot, the clock,          the drop, and seccomp)           child (and seccomp)
  modules, swap, the host name)

A machine whose layers miss a guarantee (no Landlock: Linux < 5.13 or landlock not in lsm=;
no seccomp; an unknown ABI; without namespaces, a child left with a capability after its drop)
is refused by default: `require` raises SandboxUnavailable naming what is missing and
ALLOW_WEAK_SETTING, which accepts it (then one warning). Not covered: system calls added to
kernels after the filter's tables (it refuses by name and allows the rest), and what is
readable beneath the read roots (all of /usr, the interpreter's installation).
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import platform
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from megarl.envs import sandbox_kernel
from megarl.envs.sandbox_kernel import NAMESPACE_SETUP

log = logging.getLogger("megarl.envs.sandbox")

#: name of the script the code is written to inside the folder
SCRIPT_NAME = "main.py"
#: after the process group is killed, how long its pipes may take to close (seconds)
DRAIN_GRACE_S = 2.0
#: the chunk read from the child's pipes at a time
READ_CHUNK = 65536
#: how the child prelude ends a run whose kernel layer could not be applied (sandbox_child.py)
LAYER_FAILED = 97
LAYER_FAILED_TEXT = "sandbox: a kernel layer could not be applied"
#: how long the probe of one kernel layer may take (an interpreter start, on a loaded machine)
PROBE_TIMEOUT_S = 30


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


class SandboxUnavailable(RuntimeError):
    """This machine cannot give the sandbox's guarantees, and weaker was not accepted."""


#: the setting that accepts a sandbox weaker than its guarantees (named in every refusal)
ALLOW_WEAK_SETTING = "env.options.allow_weak_sandbox=true"
#: what the sandbox promises, and the layers that hold it: any one of the alternatives, each
#: needing all of its layers (measured by tests/unit/test_sandbox_escapes.py in every mode)
GUARANTEES = {
    "writes": ("no file written, made, removed, renamed or linked outside the folder",
               (("landlock", "seccomp"), ("namespaces", "seccomp"))),
    "reads": ("no file read outside the interpreter's own library and the folder (the run's secrets, "
              "other processes' /proc, environ included)", (("landlock",),)),
    "sockets": ("no socket of any kind (network, Unix-domain, abstract)", (("seccomp",),)),
    "processes": ("no process started, signalled, traced or re-limited", (("seccomp",),)),
    # a user namespace's capabilities reach only that namespace; without one, none may be held
    "privileges": ("no capability over the machine (reboot, the clock, kernel modules, swap, the host name)",
                   (("capabilities",), ("namespaces",))),
}
_CHILD_SOURCE = Path(__file__).with_name("sandbox_child.py").read_text(encoding="utf-8")


@dataclass(frozen=True)
class SandboxLayers:
    """The kernel layers a run gets (the audit hook is always on outside tests). `why_not`
    names, for each layer that is off, why this machine does not have it. `capabilities`: the
    child's drop leaves it none (probed; every child drops what it can either way)."""
    namespaces: bool
    landlock_abi: int               # 0: no Landlock
    seccomp: bool
    capabilities: bool
    hook: bool = True
    why_not: tuple = ()             # ((layer, reason), ...)

    def missing(self) -> list[str]:
        """The guarantees (GUARANTEES' keys) these layers do not hold."""
        have = {"landlock": self.landlock_abi > 0, "seccomp": self.seccomp, "namespaces": self.namespaces,
                "capabilities": self.capabilities}
        return [g for g, (_, ways) in GUARANTEES.items() if not any(all(have[x] for x in way) for way in ways)]

    def describe(self) -> str:
        on = [name for name, ok in (("namespaces", self.namespaces), (f"landlock(abi {self.landlock_abi})",
              self.landlock_abi > 0), ("seccomp", self.seccomp), ("no capabilities", self.capabilities),
              ("audit hook", self.hook)) if ok]
        return " + ".join(on) or "no layer"


def refusal(layers: SandboxLayers) -> str:
    """The one line that refuses a run on `layers`, or "" when they hold every guarantee."""
    missing = layers.missing()
    if not missing:
        return ""
    reasons = "; ".join(f"{layer}: {why}" for layer, why in layers.why_not)
    held = ", ".join(GUARANTEES[g][0] for g in missing)
    reasons = f" ({reasons})" if reasons else ""
    privileges = " (for the capabilities: where `unshare -rmn` works, or as a user other than root)"
    return (f"sandbox: this machine cannot guarantee {held}{reasons}, so model-written code is refused. "
            f"Use a kernel with Landlock (Linux >= 5.13, landlock in lsm=) and seccomp"
            f"{privileges if 'privileges' in missing else ''}, or run the trainer in a "
            f"container of its own and set {ALLOW_WEAK_SETTING} to accept the weaker sandbox")


@lru_cache(maxsize=1)
def available_layers() -> SandboxLayers:
    """The kernel layers this machine gives, each tried once on a run of its own (a layer that
    the kernel reports but that cannot be applied, e.g. under a container's own seccomp
    profile, counts as absent, with the error; a probe that cannot tell raises, see _probe)."""
    why = []
    seccomp_why = sandbox_kernel.seccomp_supported() or _probe("seccomp")
    abi = sandbox_kernel.landlock_abi()
    landlock_why = ("the kernel has none, or it is not in lsm=" if not abi else _probe("landlock", abi))
    # the child itself reports what it holds after the drop, without namespaces (fallback mode)
    caps_why = sandbox_kernel.capabilities_supported() or _probe("capabilities")
    ns = namespaces_available()
    for layer, reason in (("seccomp", seccomp_why), ("landlock", landlock_why), ("capabilities", caps_why),
                          ("namespaces", "" if ns else "`unshare -rmn` does not work here")):
        if reason:
            why.append((layer, reason))
    layers = SandboxLayers(namespaces=ns, landlock_abi=0 if landlock_why else abi, seccomp=not seccomp_why,
                           capabilities=not caps_why, why_not=tuple(why))
    log.info("sandbox layers: %s%s", layers.describe(), "".join(f"; no {a}: {b}" for a, b in why))
    return layers


def require(allow_weak: bool = False) -> SandboxLayers:
    """The layers runs get here; raises SandboxUnavailable (naming ALLOW_WEAK_SETTING) when they
    miss a guarantee and `allow_weak` is False. With `allow_weak` one warning says what is missing."""
    layers = available_layers()
    message = refusal(layers)
    if message and not allow_weak:
        raise SandboxUnavailable(message)
    if message:
        _warn_weak(message)
    return layers


@lru_cache(maxsize=1)
def _warn_weak(message: str) -> None:
    log.warning("%s: accepted (%s)", message.split(", so ")[0], ALLOW_WEAK_SETTING)


def _probe(layer: str, abi: int = 0) -> str:
    """Run `pass` under one kernel layer alone: "" when it applies, the child's line when the
    kernel refuses it. A probe that cannot tell (it hangs past PROBE_TIMEOUT_S, cannot start, or
    ends some other way) raises SandboxUnavailable: the layer is not taken as absent on its word
    (an accepted weaker sandbox would run without it for the process's life), nor is it cached."""
    layers = SandboxLayers(namespaces=False, landlock_abi=abi if layer == "landlock" else 0,
                           seccomp=layer == "seccomp", capabilities=layer == "capabilities", hook=False)
    folder = os.path.realpath(tempfile.mkdtemp(prefix="megarl-sandbox-probe-"))
    try:
        with open(os.path.join(folder, SCRIPT_NAME), "w") as f:
            f.write("pass\n")
        done = subprocess.run(child_argv(folder, SandboxLimits(), layers), cwd=folder, env=child_env(folder),
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as err:
        raise SandboxUnavailable(f"sandbox: the probe of {layer} could not tell whether this machine has it "
                                 f"({err}); no code runs until a probe does") from err
    finally:
        _remove_folder(folder)
    stderr = _decode(done.stderr)
    failure = _layer_failure(done.returncode, stderr)
    if done.returncode == 0 or failure:
        return failure
    raise SandboxUnavailable(f"sandbox: the probe of {layer} exited {done.returncode} "
                             f"({stderr.strip()[-300:] or 'no output'}); no code runs until a probe passes")


def _layer_failure(exit_code: int, stderr: str) -> str:
    """The child prelude's line when a kernel layer could not be applied, else ""."""
    if exit_code == LAYER_FAILED and stderr.startswith(LAYER_FAILED_TEXT):
        return stderr.strip().splitlines()[0]
    return ""


@lru_cache(maxsize=1)
def namespaces_available() -> bool:
    """Whether `unshare -rmn` (user, mount and network namespaces) with the read-only set-up
    works here; tried once, on a folder of its own."""
    unshare = shutil.which("unshare")
    if not unshare:
        return False
    folder = os.path.realpath(tempfile.mkdtemp(prefix="megarl-sandbox-probe-"))
    try:
        argv = [unshare, "-rmn", "/bin/sh", "-c", NAMESPACE_SETUP, "sandbox", folder, "/bin/sh", "-c",
                f"touch probe && ! touch '{folder}-outside' 2>/dev/null"]
        return subprocess.run(argv, cwd=folder, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        _remove_folder(folder)
        if os.path.exists(folder + "-outside"):   # the set-up did not make the rest read-only
            os.remove(folder + "-outside")


def child_env(folder: str) -> dict:
    """The child's whole environment: nothing of this process's (no secrets travel)."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8"}


def child_argv(folder: str, limits: SandboxLimits, layers: SandboxLayers) -> list[str]:
    """The command line: the interpreter with the child prelude (sandbox_child.py) and what it
    applies before the code runs, inside namespaces if `layers.namespaces`."""
    config = {"folder": folder, "max_procs": limits.max_procs, "hook": layers.hook,
              "capabilities": {"last": sandbox_kernel.last_capability(), "required": layers.capabilities},
              "landlock": sandbox_kernel.landlock_plan(folder, layers.landlock_abi).as_dict()
              if layers.landlock_abi else None,
              "seccomp": sandbox_kernel.seccomp_program(platform.machine()) if layers.seccomp else None}
    python = [sys.executable, "-I", "-S", "-B", "-c", _CHILD_SOURCE, json.dumps(config)]
    if not layers.namespaces:
        return python
    return [shutil.which("unshare") or "unshare", "-rmn", "/bin/sh", "-c", NAMESPACE_SETUP, "sandbox", folder,
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


async def run_python(code: str, limits: SandboxLimits | None = None, allow_weak: bool = False) -> SandboxResult:
    """Run `code` as a script in a fresh sandboxed interpreter (see the module docstring) and
    return its output. Never raises for what the code does; raises SandboxUnavailable when this
    machine's layers miss a guarantee and `allow_weak` is False (or a layer fails to apply),
    OSError when the interpreter cannot be started at all. Cancelling the call kills the run
    and cleans up."""
    limits = limits or SandboxLimits()
    layers = require(allow_weak)
    folder = os.path.realpath(tempfile.mkdtemp(prefix="megarl-sandbox-"))
    try:
        with open(os.path.join(folder, SCRIPT_NAME), "w", encoding="utf-8") as f:
            f.write(code)
        result = await _run(child_argv(folder, limits, layers), folder, limits)
    finally:
        _remove_folder(folder)
    failure = _layer_failure(result.exit_code, result.stderr)
    if failure:
        raise SandboxUnavailable(failure)
    return result


async def _run(argv: list[str], folder: str, limits: SandboxLimits) -> SandboxResult:
    """One run of `argv` in its own process group with the rlimits, bounded by the wall clock
    and the output cap; killed (and reaped) when cancelled."""
    proc = None
    readers: list[asyncio.Future] = []
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=folder, env=child_env(folder),
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


def run_python_sync(code: str, limits: SandboxLimits | None = None, allow_weak: bool = False) -> SandboxResult:
    """`run_python` for callers without an event loop (scripts, tests). Inside a running loop,
    await run_python instead (asyncio.run refuses to nest)."""
    return asyncio.run(run_python(code, limits, allow_weak))
