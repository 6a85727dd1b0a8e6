"""The sandbox's kernel layers (megarl/envs/sandbox.py): what each one enforces, built here as
plain data in the parent and applied by the child prelude (`sandbox_child.py`) before any
model-written code runs.

* seccomp: a BPF filter (no library: the program is a list of instructions) that answers
  EPERM to every system call that creates a socket (Unix-domain and abstract ones included;
  `socketpair`, which reaches nothing, stays), makes a device / FIFO / link / symlink, changes
  a file's mode, owner, times or extended attributes (Landlock does not cover those), mounts,
  enters or makes namespaces, starts a process (fork, a non-thread clone, exec), leaves the
  process group or session, signals or re-limits another process, traces one or reads its
  memory, opens io_uring (whose operations no seccomp filter sees), or makes a privileged call
  (reboot, kexec, kernel modules, I/O ports, the clock, the kernel log, swap, the host or domain
  name, process accounting, quotas). A call from another ABI (x32, 32-bit) kills the process.
  Known ABIs: x86_64 and aarch64.
* capabilities: the child drops every one (the bounding set up to the kernel's last, ambient,
  effective, permitted, inheritable) and sets no_new_privs, then checks that none is left: as
  root without a user namespace it would otherwise keep the trainer's (reboot, the clock).
* Landlock (kernel >= 5.13, unprivileged): files may be read only beneath the interpreter's
  own prefix, the system library folders and a few device files; written, made, removed and
  renamed only beneath the sandbox folder; nothing executed. From ABI 4 TCP bind / connect are
  refused, from ABI 6 abstract Unix sockets and signals outside the sandbox are.
* namespaces (`unshare -rmn`, unprivileged user namespaces): an empty network namespace and
  every mount read-only but the folder's own.
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys
from dataclasses import dataclass

# --- seccomp ---------------------------------------------------------------------------------
# classic BPF over struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6];}
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_NR, _ARCH, _ARG0 = 0, 4, 16            # offsets; _ARG0 is the low word (little-endian ABIs)
RET_ALLOW = 0x7FFF0000
RET_KILL = 0x80000000                   # SECCOMP_RET_KILL_PROCESS
RET_EPERM = 0x00050000 | 1              # SECCOMP_RET_ERRNO | EPERM
RET_ENOSYS = 0x00050000 | 38            # clone3: glibc then falls back to clone, which is checked
CLONE_THREAD = 0x00010000
#: the placeholder for the sandboxed process's own pid, filled in by the child (it knows it)
SELF = "self"

# system calls refused outright, by name; numbers per ABI below (>= 424 are shared)
_DENY = (
    "socket", "mknod", "mknodat", "link", "linkat", "symlink", "symlinkat", "truncate",
    "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat",
    "utime", "utimes", "futimesat", "utimensat", "setxattr", "lsetxattr", "fsetxattr",
    "removexattr", "lremovexattr", "fremovexattr", "setxattrat", "removexattrat", "file_setattr",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "open_tree", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "open_tree_attr",
    "fork", "vfork", "execve", "execveat", "setsid", "setpgid",
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_open", "pidfd_getfd",
    "pidfd_send_signal", "tkill", "setpriority", "sched_setaffinity", "sched_setscheduler",
    "sched_setparam", "sched_setattr", "ioprio_set", "migrate_pages", "move_pages",
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "name_to_handle_at", "open_by_handle_at",
    # privileged calls: the child holds no capability (sandbox_child.py drops them all), so these
    # fail anyway; named here too so that a capability left by mistake still reaches none of them
    "reboot", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "iopl", "ioperm",
    "settimeofday", "clock_settime", "adjtimex", "clock_adjtime", "syslog", "swapon", "swapoff", "sethostname",
    "setdomainname", "acct", "quotactl", "quotactl_fd",
)
# allowed only when the first argument is the process itself (a signal to itself, raise())
_SELF_ONLY = ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")
_SHARED = {"pidfd_send_signal": 424, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
           "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
           "pidfd_open": 434, "clone3": 435, "pidfd_getfd": 438, "mount_setattr": 442, "fchmodat2": 452,
           "setxattrat": 463, "removexattrat": 466, "open_tree_attr": 467, "file_setattr": 469,
           "quotactl_fd": 443}
_X86_64 = {"socket": 41, "clone": 56, "fork": 57, "vfork": 58, "execve": 59, "kill": 62, "truncate": 76,
           "link": 86, "symlink": 88, "chmod": 90, "fchmod": 91, "chown": 92, "fchown": 93, "lchown": 94,
           "ptrace": 101, "setpgid": 109, "setsid": 112, "rt_sigqueueinfo": 129, "utime": 132, "mknod": 133,
           "setpriority": 141, "sched_setparam": 142, "sched_setscheduler": 144, "pivot_root": 155,
           "chroot": 161, "mount": 165, "umount2": 166, "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190,
           "removexattr": 197, "lremovexattr": 198, "fremovexattr": 199, "tkill": 200,
           "sched_setaffinity": 203, "tgkill": 234, "utimes": 235, "migrate_pages": 256, "add_key": 248,
           "request_key": 249, "keyctl": 250, "ioprio_set": 251, "mknodat": 259, "fchownat": 260,
           "futimesat": 261, "linkat": 265, "symlinkat": 266, "fchmodat": 268, "unshare": 272,
           "move_pages": 279, "utimensat": 280, "rt_tgsigqueueinfo": 297, "perf_event_open": 298,
           "prlimit64": 302, "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308,
           "process_vm_readv": 310, "process_vm_writev": 311, "sched_setattr": 314, "bpf": 321,
           "execveat": 322, "userfaultfd": 323, "syslog": 103, "adjtimex": 159, "acct": 163, "settimeofday": 164,
           "swapon": 167, "swapoff": 168, "reboot": 169, "sethostname": 170, "setdomainname": 171, "iopl": 172,
           "ioperm": 173, "init_module": 175, "delete_module": 176, "quotactl": 179, "clock_settime": 227,
           "kexec_load": 246, "clock_adjtime": 305, "finit_module": 313, "kexec_file_load": 320, **_SHARED}
_AARCH64 = {"setxattr": 5, "lsetxattr": 6, "fsetxattr": 7, "removexattr": 14, "lremovexattr": 15,
            "fremovexattr": 16, "ioprio_set": 30, "mknodat": 33, "symlinkat": 36, "linkat": 37, "umount2": 39,
            "mount": 40, "pivot_root": 41, "truncate": 45, "chroot": 51, "fchmod": 52, "fchmodat": 53,
            "fchownat": 54, "fchown": 55, "utimensat": 88, "unshare": 97, "ptrace": 117, "sched_setparam": 118,
            "sched_setscheduler": 119, "sched_setaffinity": 122, "kill": 129, "tkill": 130, "tgkill": 131,
            "rt_sigqueueinfo": 138, "setpriority": 140, "setpgid": 154, "setsid": 157, "socket": 198,
            "add_key": 217, "request_key": 218, "keyctl": 219, "clone": 220, "execve": 221,
            "migrate_pages": 238, "move_pages": 239, "rt_tgsigqueueinfo": 240, "perf_event_open": 241,
            "prlimit64": 261, "name_to_handle_at": 264, "open_by_handle_at": 265, "setns": 268,
            "process_vm_readv": 270, "process_vm_writev": 271, "sched_setattr": 274, "bpf": 280,
            "execveat": 281, "userfaultfd": 282, "quotactl": 60, "acct": 89, "kexec_load": 104, "init_module": 105,
            "delete_module": 106, "clock_settime": 112, "syslog": 116, "reboot": 142, "sethostname": 161,
            "setdomainname": 162, "settimeofday": 170, "adjtimex": 171, "swapon": 224, "swapoff": 225,
            "clock_adjtime": 266, "finit_module": 273, "kexec_file_load": 294, **_SHARED}
#: machine -> (AUDIT_ARCH_*, system call numbers, lowest number of a foreign ABI or None)
ABIS = {"x86_64": (0xC000003E, _X86_64, 0x40000000), "aarch64": (0xC00000B7, _AARCH64, None)}


def seccomp_program(machine: str) -> list[tuple]:
    """The filter for `machine` (platform.machine()) as (code, jt, jf, k) instructions; k may be
    SELF (the child puts its pid there). Raises KeyError for an ABI without a table here."""
    audit_arch, nrs, foreign = ABIS[machine]
    prog = [(_LD_ABS, 0, 0, _ARCH), (_JEQ, 1, 0, audit_arch), (_RET, 0, 0, RET_KILL), (_LD_ABS, 0, 0, _NR)]
    if foreign is not None:
        prog += [(_JGE, 0, 1, foreign), (_RET, 0, 0, RET_KILL)]
    for name in _DENY:
        if name in nrs:    # a call this ABI does not have (fork on aarch64) needs no rule
            prog += [(_JEQ, 0, 1, nrs[name]), (_RET, 0, 0, RET_EPERM)]
    prog += [(_JEQ, 0, 1, nrs["clone3"]), (_RET, 0, 0, RET_ENOSYS)]
    # clone: threads only (the flags are the first argument on both ABIs)
    prog += [(_JEQ, 0, 4, nrs["clone"]), (_LD_ABS, 0, 0, _ARG0), (_JSET, 1, 0, CLONE_THREAD),
             (_RET, 0, 0, RET_EPERM), (_RET, 0, 0, RET_ALLOW)]
    for name in _SELF_ONLY:
        prog += [(_JEQ, 0, 4, nrs[name]), (_LD_ABS, 0, 0, _ARG0), (_JEQ, 1, 0, SELF),
                 (_RET, 0, 0, RET_EPERM), (_RET, 0, 0, RET_ALLOW)]
    # prlimit64: its own limits (pid 0 or itself) only
    prog += [(_JEQ, 0, 5, nrs["prlimit64"]), (_LD_ABS, 0, 0, _ARG0), (_JEQ, 2, 0, 0), (_JEQ, 1, 0, SELF),
             (_RET, 0, 0, RET_EPERM), (_RET, 0, 0, RET_ALLOW)]
    return prog + [(_RET, 0, 0, RET_ALLOW)]


def seccomp_supported() -> str:
    """Why seccomp cannot be used here, or "" when it can (an ABI with a table, a kernel with
    filters that can answer an errno)."""
    if sys.platform != "linux":
        return f"not Linux ({sys.platform})"
    if platform.machine() not in ABIS:
        return f"no system call table for {platform.machine()} (known: {', '.join(ABIS)})"
    try:
        with open("/proc/sys/kernel/seccomp/actions_avail") as f:
            actions = f.read().split()
    except OSError:
        return "the kernel has no seccomp filters (/proc/sys/kernel/seccomp/actions_avail missing)"
    missing = {"errno", "kill_process", "allow"} - set(actions)
    return f"the kernel's seccomp lacks {sorted(missing)}" if missing else ""


# --- Landlock --------------------------------------------------------------------------------
(EXECUTE, WRITE_FILE, READ_FILE, READ_DIR, REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR, MAKE_REG,
 MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM, REFER, TRUNCATE, IOCTL_DEV) = (1 << i for i in range(16))
READ = READ_FILE | READ_DIR
#: inside the folder: files and folders made, written, removed, renamed (no devices, FIFOs,
#: sockets or symlinks; seccomp refuses those everywhere anyway); nothing executed
FOLDER = READ | WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_DIR | MAKE_REG | REFER | TRUNCATE
#: the access rights each ABI version adds (v4 adds network rights, v6 scopes, v7 logging)
_FS_BY_ABI = {1: (1 << 13) - 1, 2: REFER, 3: TRUNCATE, 5: IOCTL_DEV}
NET_TCP = 1 | 2                                   # BIND_TCP | CONNECT_TCP (ABI 4)
SCOPES = 1 | 2                                    # ABSTRACT_UNIX_SOCKET | SIGNAL (ABI 6)
#: system folders the standard library's extension modules load shared libraries from
SYSTEM_READ = ("/usr", "/lib", "/lib64", "/lib32", "/etc/ld.so.cache", "/etc/localtime",
               "/sys/devices/system/cpu")
#: device files ordinary code opens (read), and the one it may write to
DEVICES_READ = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
_SYS_LANDLOCK_CREATE_RULESET = 444


def landlock_abi() -> int:
    """The kernel's Landlock ABI version: 0 when it has none or has it disabled (not in the
    lsm= boot list), or is not Linux."""
    if sys.platform != "linux":
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    version = libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(0, int(version))


def handled_fs(abi: int) -> int:
    """Every file-system right the ABI knows: all of them are refused unless a rule grants them."""
    return sum(bits for version, bits in _FS_BY_ABI.items() if version <= abi)


def read_roots() -> list[str]:
    """Where the sandboxed interpreter may read: its own installation (the standard library and
    the libraries it links, wherever Python was installed: a system one, pyenv, conda) and the
    system library folders. Not the working tree, HOME, /tmp, /proc or /etc (secrets live there)."""
    roots = [sys.base_prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))]
    # an interpreter installed at / would open everything: its library is under /usr or /lib then
    return [p for p in dict.fromkeys(os.path.realpath(p) for p in (*roots, *SYSTEM_READ)) if p != "/"]


def landlock_rules(folder: str, abi: int) -> list[tuple[str, int]]:
    """(path, rights) pairs for the child to add; a file gets only the rights a file can have."""
    handled = handled_fs(abi)
    file_rights = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV
    rules = [(p, READ) for p in read_roots()]
    rules += [(p, READ_FILE) for p in DEVICES_READ] + [("/dev/null", READ_FILE | WRITE_FILE)]
    rules.append((folder, FOLDER))
    out = []
    for path, rights in rules:
        if os.path.isfile(path) or os.path.exists(path) and not os.path.isdir(path):
            rights &= file_rights
        out.append((path, rights & handled))
    return out


@dataclass(frozen=True)
class LandlockPlan:
    """What the child asks of Landlock: the handled rights (refused unless granted) and the rules."""
    abi: int
    handled_fs: int
    handled_net: int
    scoped: int
    rules: tuple

    def as_dict(self) -> dict:
        return {"abi": self.abi, "fs": self.handled_fs, "net": self.handled_net, "scoped": self.scoped,
                "rules": [list(r) for r in self.rules]}


def landlock_plan(folder: str, abi: int) -> LandlockPlan:
    return LandlockPlan(abi=abi, handled_fs=handled_fs(abi), handled_net=NET_TCP if abi >= 4 else 0,
                        scoped=SCOPES if abi >= 6 else 0, rules=tuple(landlock_rules(folder, abi)))


# --- capabilities ----------------------------------------------------------------------------
_PR_CAPBSET_READ = 23


def last_capability() -> int:
    """The highest capability number this kernel knows: the child drops the bounding set up to it.
    Read from /proc/sys/kernel/cap_last_cap, or, where /proc does not say, asked of the kernel
    itself (PR_CAPBSET_READ answers EINVAL past the last one)."""
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except (OSError, ValueError):
        libc = ctypes.CDLL(None, use_errno=True)
        cap = 0
        while cap < 63 and libc.prctl(_PR_CAPBSET_READ, ctypes.c_ulong(cap + 1), ctypes.c_ulong(0),
                                      ctypes.c_ulong(0), ctypes.c_ulong(0)) >= 0:
            cap += 1
        return cap


def capabilities_supported() -> str:
    """Why the child's capabilities cannot be dropped here, or "" when they can (it is then
    probed: sandbox.available_layers)."""
    return "" if sys.platform == "linux" else f"not Linux ({sys.platform})"


# --- namespaces ------------------------------------------------------------------------------
# Runs inside the new namespaces before the interpreter: the folder becomes a mount of its own,
# then every mount is made read-only (all but the folder's own). A mount the kernel will not
# remount (some pseudo file systems) is left as it is; argv: [folder, command...]. A step that
# fails ends the run as a layer that cannot be applied does (sandbox.LAYER_FAILED and its line),
# so the caller raises instead of reporting the model's code as failed.
NAMESPACE_SETUP = r'''
d="$1"; shift
fail() { echo "sandbox: a kernel layer could not be applied (namespaces: $1)" >&2; exit 97; }
err=$(mount --bind "$d" "$d" 2>&1) || fail "mount --bind of the folder: $err"
cd "$d" 2>/dev/null || fail "cd into the folder's own mount"   # the inherited cwd still points below it
while read -r _ _ _ _ mp _; do
  mp=$(printf '%b' "$mp")
  [ "$mp" = "$d" ] || mount -o remount,bind,ro "$mp" 2>/dev/null || true
done < /proc/self/mountinfo
exec "$@"
'''
