"""The sandbox's child holds no privilege over the machine (megarl/envs/sandbox.py), in every
mode: as root without a user namespace (fallback mode, as in many containers) it would otherwise
keep the trainer's capabilities, and `reboot` or `settimeofday` would pass their capability check.

Each privileged call is made so that it changes nothing even where the check passes: `reboot`
with a bad magic (EINVAL once CAP_SYS_BOOT is held), `settimeofday(NULL, NULL)` (a no-op that
returns 0 with CAP_SYS_TIME), `delete_module` of a module that does not exist (ENOENT with
CAP_SYS_MODULE), `swapoff` of a path that does not exist (ENOENT with CAP_SYS_ADMIN). Without the
capability, or under the filter, each answers EPERM. The tests mean most when run as root (this
machine, CI's containers); as another user the child starts without capabilities anyway."""
from __future__ import annotations

import base64
import os
import platform
import re
import shutil
import subprocess

import pytest
from sandbox_modes import FAST, KERNEL_MODES, MODES, bpf, force

from megarl.envs import sandbox, sandbox_kernel
from megarl.envs.sandbox import SandboxUnavailable, run_python_sync

EPERM = 1
CAP_SETPCAP = 8
#: the privileged calls the filter refuses (issue 45), and the ABIs that do not have some of them
PRIVILEGED = ("reboot", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "iopl",
              "ioperm", "settimeofday", "clock_settime", "adjtimex", "clock_adjtime", "syslog", "swapon", "swapoff",
              "sethostname", "setdomainname", "mount", "umount2", "pivot_root", "acct", "quotactl", "quotactl_fd")
ABSENT = {"aarch64": {"iopl", "ioperm"}}
#: the calls the child tries, numbered here (not from the filter's tables, which they check)
TRIED = {"x86_64": {"reboot": 169, "settimeofday": 164, "delete_module": 176, "swapoff": 168},
         "aarch64": {"reboot": 142, "settimeofday": 170, "delete_module": 106, "swapoff": 225}}


@pytest.mark.parametrize("machine", sorted(sandbox_kernel.ABIS))
def test_the_filter_refuses_the_privileged_calls(machine):
    """Each privileged call the ABI has is answered EPERM by the filter, whatever the capabilities
    (a second wall: the drop is the first)."""
    arch, nrs, _ = sandbox_kernel.ABIS[machine]
    prog = sandbox_kernel.seccomp_program(machine)
    wanted = set(PRIVILEGED) - ABSENT.get(machine, set())
    assert sorted(wanted - set(nrs)) == []
    assert {name: bpf(prog, arch, nrs[name]) for name in sorted(wanted)} == \
        {name: sandbox_kernel.RET_EPERM for name in sorted(wanted)}


def _parent_holds(cap: int) -> bool:
    with open("/proc/self/status") as f:
        eff = next(line.split()[1] for line in f if line.startswith("CapEff:"))
    return bool(int(eff, 16) >> cap & 1)


def _bounding_cleared(mode: str) -> bool:
    """Whether the child can clear its bounding set: it needs CAP_SETPCAP, which root has and a user
    namespace's root has; another user's child cannot, and needs not (no_new_privs, no exec)."""
    return mode.startswith("ns") or _parent_holds(CAP_SETPCAP)


def _verdict(line: str) -> dict:
    """{key: int} from the probe's `key=hex ...` line."""
    return {key: int(value, 16) for key, value in (item.split("=") for item in line.split())}


#: what the child holds and each call's errno (0: it succeeded), in every mode
EXPECTED = {"effective": 0, "permitted": 0, "inheritable": 0, "nnp": 1, "reboot": EPERM, "settimeofday": EPERM,
            "delete_module": EPERM, "swapoff": EPERM}


def _check(mode: str, got: dict) -> None:
    bounding = got.pop("bounding")
    assert got == EXPECTED
    if _bounding_cleared(mode):
        assert bounding == 0, hex(bounding)


# ctypes in the child (the kernel modes: no audit hook) reads what it holds and tries each call
CTYPES_PROBE = """
import ctypes
NR = {nrs!r}
LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.syscall.restype = ctypes.c_long
def call(name, *args):
    args = [a if isinstance(a, bytes) else ctypes.c_long(a) for a in args]
    return 0 if LIBC.syscall(ctypes.c_long(NR[name]), *args) != -1 else ctypes.get_errno()
head, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()   # capability version 3
assert LIBC.capget(head, data) == 0
word = lambda i: data[i] | data[i + 3] << 32
bounding = sum(1 << cap for cap in range(64) if LIBC.prctl(23, ctypes.c_long(cap), 0, 0, 0) == 1)   # PR_CAPBSET_READ
print("effective=%x permitted=%x inheritable=%x bounding=%x nnp=%x reboot=%x settimeofday=%x delete_module=%x "
      "swapoff=%x" % (word(0), word(1), word(2), bounding, LIBC.prctl(39, 0, 0, 0, 0), call("reboot", 0, 0, 0, 0),
      call("settimeofday", 0, 0), call("delete_module", b"megarl_absent", 2048),
      call("swapoff", b"/megarl-absent-swap")))
"""


@pytest.mark.parametrize("mode", [m for m in KERNEL_MODES if m.endswith("kernel")])
def test_the_child_holds_no_capability(mode, monkeypatch):
    """Without the audit hook (native code's view): no effective, permitted or inheritable
    capability, an empty bounding set where it can be cleared, no_new_privs, and each privileged
    call refused with EPERM, in fallback mode as with namespaces."""
    force(monkeypatch, mode)
    res = run_python_sync(CTYPES_PROBE.format(nrs=TRIED[platform.machine()]), FAST)
    assert res.exit_code == 0, res.stderr
    _check(mode, _verdict(res.stdout))


# a compiled extension the code writes into its folder and imports: past the audit hook, it
# reports through the ImportError its init raises (no Python headers needed to build it)
EXTENSION_C = r"""
#include <errno.h>
#include <stdio.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <linux/capability.h>
extern void *PyExc_ImportError;
extern void PyErr_SetString(void *, const char *);
static long try_call(long nr, long a, long b, long c, long d) {
    return syscall(nr, a, b, c, d) == -1 ? errno : 0;
}
void *PyInit_privprobe(void) {
    struct __user_cap_header_struct head = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2] = {{0}};
    unsigned long long bounding = 0;
    char out[512];
    syscall(SYS_capget, &head, data);
    for (int cap = 0; cap < 64; cap++)
        if (prctl(PR_CAPBSET_READ, cap, 0, 0, 0) == 1) bounding |= 1ULL << cap;
    snprintf(out, sizeof out, "effective=%llx permitted=%llx inheritable=%llx bounding=%llx nnp=%x reboot=%lx "
             "settimeofday=%lx delete_module=%lx swapoff=%lx",
             data[0].effective | (unsigned long long)data[1].effective << 32,
             data[0].permitted | (unsigned long long)data[1].permitted << 32,
             data[0].inheritable | (unsigned long long)data[1].inheritable << 32, bounding,
             prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0), try_call(SYS_reboot, 0, 0, 0, 0),
             try_call(SYS_settimeofday, 0, 0, 0, 0), try_call(SYS_delete_module, (long)"megarl_absent", 2048, 0, 0),
             try_call(SYS_swapoff, (long)"/megarl-absent-swap", 0, 0, 0));
    PyErr_SetString(PyExc_ImportError, out);
    return 0;
}
"""


@pytest.fixture(scope="module")
def extension(tmp_path_factory) -> bytes:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if not gcc:
        pytest.skip("no C compiler here to build the extension")
    folder = tmp_path_factory.mktemp("privprobe")
    (folder / "privprobe.c").write_text(EXTENSION_C)
    subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-o", str(folder / "privprobe.so"), str(folder / "privprobe.c")],
                   check=True, capture_output=True, timeout=120)
    return (folder / "privprobe.so").read_bytes()


@pytest.mark.parametrize("mode", MODES)
def test_an_extension_the_code_writes_meets_the_same_walls(mode, monkeypatch, extension):
    """With the audit hook on, the code writes a compiled extension into its folder and imports
    it (the hook does not see native code): it holds no capability either, and each privileged
    call is refused, so the walls are the kernel's (the drop and the filter), not the hook."""
    force(monkeypatch, mode)
    code = f"""
import base64
open("privprobe.so", "wb").write(base64.b64decode({base64.b64encode(extension)!r}))
try:
    import privprobe
except ImportError as err:
    print(err)
"""
    res = run_python_sync(code, FAST)
    assert res.exit_code == 0, res.stderr
    _check(mode, _verdict(res.stdout))


@pytest.fixture
def root_with_setpcap():
    """The finding needs root (a child that starts with capabilities to keep)."""
    if os.geteuid() != 0 or not _parent_holds(CAP_SETPCAP):
        pytest.skip("only root's child starts with capabilities (and CAP_SETPCAP to clear its bounding set)")


@pytest.mark.parametrize("mode", MODES)
def test_a_child_left_with_a_capability_fails_closed(mode, monkeypatch, root_with_setpcap):
    """The child drops the capabilities the parent names, then reads what it still holds: a list
    one short of the kernel's (a stale cap_last_cap) leaves some in the bounding set, and the run
    ends before the code starts, the call raising, instead of running with them."""
    force(monkeypatch, mode)
    monkeypatch.setattr(sandbox_kernel, "last_capability", lambda: 20)
    with pytest.raises(SandboxUnavailable, match="could not be applied .*capabilit"):
        run_python_sync("print('ran')", FAST)


@pytest.fixture
def fresh_probe():
    """available_layers probes this machine again in the test, and again after it."""
    sandbox.available_layers.cache_clear()
    yield
    sandbox.available_layers.cache_clear()


def test_fallback_mode_is_refused_when_the_child_keeps_a_capability(monkeypatch, fresh_probe, root_with_setpcap):
    """The probe sees the child keep a capability: without namespaces the machine is refused, with
    one line naming the missing guarantee and the child's reason; with namespaces (whose
    capabilities do not reach the machine) it holds."""
    monkeypatch.setattr(sandbox_kernel, "last_capability", lambda: 20)
    monkeypatch.setattr(sandbox, "namespaces_available", lambda: False)
    layers = sandbox.available_layers()
    if layers.seccomp is False or not layers.landlock_abi:
        pytest.skip(f"this machine lacks another kernel layer: {sandbox.refusal(layers)}")
    assert (layers.capabilities, layers.missing()) == (False, ["privileges"])
    line = sandbox.refusal(layers)
    assert "\n" not in line and sandbox.GUARANTEES["privileges"][0] in line and "bounding" in line
    with pytest.raises(SandboxUnavailable, match=re.escape(sandbox.GUARANTEES["privileges"][0])):
        run_python_sync("print('ran')", FAST)
    assert sandbox.SandboxLayers(namespaces=True, landlock_abi=1, seccomp=True, capabilities=False).missing() == []
