"""The sandboxed interpreter's prelude (megarl/envs/sandbox.py): never imported; its text runs
with `python -I -S -B -c` before the model-written code, in the child process.

argv: [a JSON object]: folder, max_procs, capabilities ({"last": the kernel's last capability,
"required": whether one left ends the run}), landlock (a plan from sandbox_kernel, or null),
seccomp (the filter's instructions, or null), hook (whether to install the audit hook).
In order: the process limit, the capability drop, Landlock, seccomp, the audit hook, then
main.py. A kernel layer that was asked for and cannot be applied ends the run (exit 97, one
line on stderr): the sandbox fails closed, never weaker than the parent decided.

Everything the hook relies on is bound in its closure at install time (posix functions, not
os.path ones that the code could replace), and it never calls code of the sandboxed program
except os.fspath on a path object.
"""
import json
import resource
import sys
import traceback
import types

#: the exit status of a run whose kernel layer could not be applied
LAYER_FAILED = 97


def _capabilities(plan):
    """Drop every capability and set no_new_privs: as root without a user namespace the code
    would otherwise keep the trainer's (reboot, the clock, kernel modules would pass their
    checks). Raises, when plan["required"], if a step fails or a capability is left; otherwise
    (a weaker sandbox accepted) drops what it can."""
    try:
        problems = _drop_capabilities(plan["last"])
    except OSError as err:   # capget refused: nothing can be said of what is held
        problems = [str(err)]
    if plan["required"] and problems:
        raise OSError("capabilities: not all dropped (%s)" % ", ".join(problems))


def _drop_capabilities(last):
    """The drop itself; returns what went wrong and what is left (empty: nothing is held)."""
    import ctypes
    import posix
    libc = ctypes.CDLL(None, use_errno=True)
    problems = []

    def prctl(option, *args):
        return libc.prctl(option, *[ctypes.c_ulong(a) for a in (*args, 0, 0, 0, 0)[:4]])

    def step(result, what):
        if result < 0:
            problems.append("%s: %s" % (what, posix.strerror(ctypes.get_errno())))

    step(prctl(38, 1), "PR_SET_NO_NEW_PRIVS")
    # the bounding set (what an exec could give back) shrinks only with CAP_SETPCAP (EPERM
    # without): root has it; another user's child cannot clear it and needs not (no_new_privs,
    # and exec is refused). Tried on capability 0 first, so that the drop needs no capget.
    setpcap = prctl(24, 0) == 0
    for cap in range(1, last + 1) if setpcap else ():
        step(prctl(24, cap), "PR_CAPBSET_DROP(%d)" % cap)
    step(prctl(47, 4), "PR_CAP_AMBIENT_CLEAR_ALL")
    step(libc.capset((ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()), "capset(none)")
    problems += ["%s=%x" % (name, caps) for name, caps in _held(libc, prctl).items()
                 if caps and (name != "bounding" or setpcap)]
    if prctl(39) != 1:
        problems.append("no_new_privs unset")
    return problems


def _held(libc, prctl):
    """The capability sets this process holds, as bit masks (the ambient set needs no reading:
    the kernel keeps it within permitted and inheritable)."""
    import ctypes
    data = (ctypes.c_uint32 * 6)()   # two struct __user_cap_data_struct (version 3: 64 bits)
    if libc.capget((ctypes.c_uint32 * 2)(0x20080522, 0), data) < 0:
        raise OSError(ctypes.get_errno(), "capget")
    sets = {name: data[i] | data[i + 3] << 32 for i, name in enumerate(("effective", "permitted", "inheritable"))}
    # PR_CAPBSET_READ: 1 held, 0 not, -1 (EINVAL) past the kernel's last capability
    sets["bounding"] = sum(1 << cap for cap in range(64) if prctl(23, cap) == 1)
    return sets


def _kernel(landlock, seccomp):
    """Apply Landlock (a plan: handled rights, rules) and the seccomp filter, through ctypes;
    neither can be undone by this process or anything it starts."""
    import ctypes
    import posix
    import struct
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long

    def check(result, what):
        if result < 0:
            err = ctypes.get_errno()
            raise OSError(err, "%s: %s" % (what, posix.strerror(err)))
        return result

    long_ = ctypes.c_long
    check(libc.prctl(38, long_(1), long_(0), long_(0), long_(0)), "prctl(PR_SET_NO_NEW_PRIVS)")
    if landlock:
        abi = landlock["abi"]
        attr = (ctypes.c_uint64 * 3)(landlock["fs"], landlock["net"], landlock["scoped"])
        size = 8 if abi < 4 else 16 if abi < 6 else 24   # the struct grew with the ABI
        ruleset = check(libc.syscall(long_(444), ctypes.byref(attr), long_(size), long_(0)),
                        "landlock_create_ruleset")

        class PathBeneath(ctypes.Structure):
            _pack_ = 1
            _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

        for path, rights in landlock["rules"]:
            try:
                fd = posix.open(path, posix.O_PATH | posix.O_CLOEXEC)
            except OSError:
                continue   # not on this machine (/lib32, /lib64): nothing to grant there
            try:
                check(libc.syscall(long_(445), long_(ruleset), long_(1), ctypes.byref(PathBeneath(rights, fd)),
                                   long_(0)), "landlock_add_rule(%s)" % path)
            finally:
                posix.close(fd)
        check(libc.syscall(long_(446), long_(ruleset), long_(0)), "landlock_restrict_self")
        posix.close(ruleset)
    if seccomp:
        pid = posix.getpid()
        raw = b"".join(struct.pack("=HBBI", code, jt, jf, pid if k == "self" else k) for code, jt, jf, k in seccomp)
        program = ctypes.create_string_buffer(raw, len(raw))

        class Fprog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

        fprog = Fprog(len(seccomp), ctypes.cast(program, ctypes.c_void_p))
        check(libc.prctl(22, long_(2), ctypes.byref(fprog), long_(0), long_(0)), "prctl(PR_SET_SECCOMP)")
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]   # an `import ctypes` in the code then meets the hook again


def _paths(root):
    """inside(path, dir_fd) and absolute(path) for the hook, bound to posix functions now."""
    import posix
    getcwd, readlink, fspath = posix.getcwd, posix.readlink, posix.fspath

    def where(path, dir_fd):
        """The absolute, lexically normalised path an event acts on (raises when it cannot
        tell). Lexical is enough for the hook's own refusals: the kernel layers hold where
        links or races could make the lexical path lie."""
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

    return inside, absolute


def _install(root):
    """The audit hook: the ordinary ways out refused with a message that says why (the kernel
    layers refuse the rest, and what gets past the hook)."""
    import posix
    getpid = posix.getpid
    inside, absolute = _paths(root)
    WRITE = posix.O_WRONLY | posix.O_RDWR | posix.O_CREAT | posix.O_TRUNC | posix.O_APPEND
    DENY = frozenset({"subprocess.Popen", "os.system", "os.fork", "os.forkpty", "os.symlink", "os.link",
                      "os.killpg", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
                      "cpython.PyInterpreterState_New", "sqlite3.enable_load_extension",
                      "sqlite3.load_extension"})
    PREFIX = ("socket.", "ctypes.", "os.exec", "os.spawn", "os.posix_spawn")
    NO_IMPORT = frozenset({"ctypes", "_ctypes", "_posixsubprocess", "_xxsubinterpreters", "_testcapi",
                           "_testinternalcapi", "posix", "_io", "builtins", "sys", "_imp"})
    # event -> (index of the path, index of its dir_fd or None), for events that change files
    PATHS = {"os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),), "os.chmod": ((0, 2),),
             "os.chown": ((0, 3),), "os.utime": ((0, 3),), "os.truncate": ((0, None),),
             "os.rename": ((0, 2), (1, 3)), "shutil.rmtree": ((0, 1),),
             "os.setxattr": ((0, None),), "os.removexattr": ((0, None),)}

    def refuse(what):
        raise PermissionError("sandbox: %s is not allowed" % what)

    def hook(event, args):
        if event in DENY or event.startswith(PREFIX):
            if event != "socket.__new__":   # the kernel refuses the socket itself, with its own error
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
        elif event == "sqlite3.connect":
            # sqlite opens its files itself (no "open" event): the database path is checked here
            name = args[0]
            if name not in (":memory:", "", b":memory:", b"") and not inside(name):
                refuse("a database %r outside the sandbox folder" % (name,))
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


def _layers(config):
    try:
        _capabilities(config["capabilities"])
        if config["landlock"] or config["seccomp"]:
            _kernel(config["landlock"], config["seccomp"])
    except Exception as err:   # noqa: BLE001 - fail closed, whatever went wrong
        sys.stderr.write("sandbox: a kernel layer could not be applied (%s: %s)\n" % (type(err).__name__, err))
        sys.stderr.flush()
        import posix
        posix._exit(LAYER_FAILED)
    if config["hook"]:
        _install(config["folder"])


def main():
    config = json.loads(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_NPROC, (config["max_procs"],) * 2)
    _layers(config)
    path = config["folder"] + "/main.py"
    sys.argv = [path]
    sys.path.insert(0, config["folder"])   # modules the code writes itself
    try:
        with open(path, "rb") as f:
            code = compile(f.read(), path, "exec")
        # a clean __main__ of its own (pickle and `import __main__` find the code's names there)
        module = sys.modules["__main__"] = types.ModuleType("__main__")
        module.__file__ = path
        exec(code, module.__dict__)
    except SystemExit:
        raise
    except BaseException as err:
        # drop the prelude's own frames: the traceback starts in main.py
        tb = err.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != path:
            tb = tb.tb_next
        traceback.print_exception(type(err), err, tb)
        sys.exit(1)


if __name__ == "__main__":
    main()
