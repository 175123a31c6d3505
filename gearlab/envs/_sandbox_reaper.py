"""The sandbox's trusted first process: run as a script by :mod:`gearlab.envs.sandbox`, never imported.

``python -I -S _sandbox_reaper.py HEXCONFIG`` where HEXCONFIG is the hex of a ``marshal``-ed dict built by
``sandbox._run`` (keys documented there). In order, each step only if the config asks for it:

1. wait until the parent has moved it into the call's cgroups (memory / pids cap for the whole tree), enter new
   mount, network, pid, IPC, UTS and cgroup namespaces;
2. build the new root: a read-only tmpfs holding read-only bind mounts of the interpreter, its stdlib and
   shared libraries, a minimal ``/dev``, and one size-capped tmpfs bound at ``/work``, ``/tmp``, ``/var/tmp`` and
   ``/dev/shm``; ``pivot_root`` into it and detach the host's tree;
3. fork. The child (pid 1 of the new pid namespace) mounts a fresh ``/proc``, sets the rlimits, drops to the
   call's uid/gid, installs the seccomp filter (no new privileges), closes every other fd and runs ``main.py``
   in this same, already started interpreter (``run_main``: as ``python -I -S main.py`` would, minus a second
   interpreter start-up). The reaper drops to ``nobody``, waits and mirrors the child's exit status (a signal
   death is re-raised on itself).

Progress is written to the info fd as ``key=value`` lines (``net=1``, ``pid=1``, ``fs=1``, ``seccomp=1``, and
``started=1`` last, just before the user's code runs); a
failed step writes ``error=...`` and exits with the config's ``setup_failed`` status, so the user's code never
runs with less isolation than asked for. Standard library only (any Python >= 3.8); nothing from gearlab.
"""
import _signal as signal  # the C module under ``signal``: same names, without importing enum (~3 ms)
import atexit
import ctypes
import marshal
import os
import resource
import sys

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MNT_DETACH = 0x2
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_MODE_FILTER = 2
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000

C = marshal.loads(bytes.fromhex(sys.argv[1]))
INFO = C["info_fd"]
LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
LIBC.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
LIBC.unshare.argtypes = [ctypes.c_int]
LIBC.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def report(line):
    os.write(INFO, line.encode("utf-8", "replace") + b"\n")


def check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, "%s: %s" % (what, os.strerror(err)))


def encode(s):
    return None if s is None else s.encode()


def mount(src, dst, fstype, flags, data=None):
    check(LIBC.mount(encode(src), encode(dst), encode(fstype), flags, encode(data)),
          "mount %s on %s" % (src or fstype, dst))


def ro_bind(src, dst):
    """Bind host path ``src`` (file or directory) read-only, nosuid, nodev at ``dst``."""
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    mount(src, dst, None, MS_BIND)
    # a bind mount takes the flags of its source; read-only needs this second, remount step
    mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def rw_bind(src, dst, flags):
    mount(src, dst, None, MS_BIND)
    mount(None, dst, None, MS_BIND | MS_REMOUNT | flags)


def enter_namespaces():
    flags = C["ns_flags"]
    if not flags:
        return
    if LIBC.unshare(flags) == 0:
        report("net=%d" % bool(flags & CLONE_NEWNET))
        report("pid=%d" % bool(flags & CLONE_NEWPID))
        return
    if C["ns_required"]:
        check(-1, "unshare")
    # best effort (a host that refuses some namespace kinds): network and pid ones on their own
    report("net=%d" % (LIBC.unshare(CLONE_NEWNET) == 0))
    report("pid=%d" % (LIBC.unshare(CLONE_NEWPID) == 0))


def build_root():
    """Make the new root at C["root"] and pivot into it (we are root, in our own mount namespace)."""
    root, scratch = C["root"], C["scratch"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount propagates back to the host
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=755")
    for op in C["plan"]:
        dst = root + op[1]
        if op[0] == "dir":
            os.makedirs(dst, exist_ok=True)
        elif op[0] == "link":
            os.symlink(op[2], dst)
        else:
            ro_bind(op[1], dst)
    # one tmpfs for everything writable, so its size caps them all together
    mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
          "size=%d,nr_inodes=%d,mode=755" % (C["scratch_bytes"], C["scratch_inodes"]))
    uid, gid = C["uid"], C["gid"]
    for name, mode in (("work", 0o700), ("tmp", 0o1777), ("vartmp", 0o1777), ("shm", 0o1777)):
        path = os.path.join(scratch, name)
        os.mkdir(path)
        os.chmod(path, mode)
        if uid is not None and name == "work":
            os.chown(path, uid, gid)
    main_py = os.path.join(scratch, "work", "main.py")
    with open(C["main"], "rb") as src, open(main_py, "wb") as dst:
        dst.write(src.read())
    if uid is not None:
        os.chown(main_py, uid, gid)
    dev = root + "/dev"
    os.makedirs(dev, exist_ok=True)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=755")
    for name in ("null", "zero", "full", "random", "urandom"):
        open(os.path.join(dev, name), "a").close()
        rw_bind("/dev/" + name, os.path.join(dev, name), MS_NOSUID | MS_NOEXEC)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, os.path.join(dev, name))
    os.mkdir(dev + "/shm")
    for name, dst in (("work", "/work"), ("tmp", "/tmp"), ("vartmp", "/var/tmp"), ("shm", "/dev/shm")):
        os.makedirs(root + dst, exist_ok=True)
        rw_bind(os.path.join(scratch, name), root + dst, MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mount(None, dev, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    os.makedirs(root + "/proc", exist_ok=True)
    os.chdir(root)
    # pivot_root(".", "."): the old root ends up stacked on "/", detaching it leaves only the new tree
    check(LIBC.syscall(ctypes.c_long(C["nr_pivot_root"]), b".", b"."), "pivot_root")
    check(LIBC.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    report("fs=1")


def drop_to(uid, gid):
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def child():
    """Runs in the forked child: finish the isolation, then run the user's code; never returns."""
    try:
        if C["fs"]:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        os.chdir(C["cwd"])
        for name, lim in C["rlimits"]:
            resource.setrlimit(getattr(resource, name), (lim, lim))
        if C["uid"] is not None:
            drop_to(C["uid"], C["gid"])
            # a uid change without execve leaves the process non-dumpable, which makes its /proc/self root-owned
            # (no /dev/stdout, no /proc/self/fd); execve would have reset it to 1, as this does
            check(LIBC.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "PR_SET_DUMPABLE")
        # set after the uid change, which clears it: the code dies with the reaper
        check(LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")
        if C["seccomp"]:
            check(LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
            buf = ctypes.create_string_buffer(C["seccomp"], len(C["seccomp"]))
            prog = SockFprog(len(C["seccomp"]) // 8, ctypes.addressof(buf))
            check(LIBC.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0), "PR_SET_SECCOMP")
            report("seccomp=1")
        report("started=1")
        os.close(INFO)
        os.closerange(3, 256)
        with open(C["main_path"], "rb") as f:
            source = f.read()
    except BaseException as e:  # any failure here is a setup failure: reported, never raised
        try:
            report("error=child setup: %r" % (e,))
        finally:
            os._exit(C["setup_failed"])
    run_main(source)


def run_main(source):
    """Run ``source`` as ``python -I -S main.py`` would, in this already started interpreter (no second
    interpreter start-up per call): a fresh ``__main__``, tracebacks that start at the user's code, the same exit
    status (1 on an uncaught exception, ``SystemExit``'s code), then the interpreter's shutdown steps a program
    can observe - non-daemon threads joined, ``atexit`` handlers run, stdout / stderr flushed - and ``_exit``.
    The rest of a normal shutdown (freeing every object) is skipped: in a forked interpreter it copies each
    page of the heap it touches and costs ~10 ms."""
    path = C["main_path"]
    module = type(sys)("__main__")
    module.__file__ = path
    sys.modules["__main__"] = module
    sys.argv = [path]
    try:
        try:
            exec(compile(source, path, "exec"), module.__dict__)
        finally:
            if "threading" in sys.modules:
                sys.modules["threading"]._shutdown()  # what Py_FinalizeEx calls to join non-daemon threads
        status = 0
    except SystemExit as e:
        status = exit_status(e)
    except BaseException as e:  # reported like the interpreter does
        tb = e.__traceback__
        e.__traceback__ = tb.tb_next if tb is not None else None  # the display reads it from the exception
        sys.excepthook(type(e), e, e.__traceback__)
        status = 1
    try:
        atexit._run_exitfuncs()
    except SystemExit as e:
        status = exit_status(e)
    except BaseException:  # the interpreter prints these and keeps the status
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None and not stream.closed:
                stream.flush()
        except BaseException:  # e.g. a closed pipe; the interpreter exits 120 then
            status = 120 if status == 0 else status
    os._exit(status)


def exit_status(e):
    """The process exit status the interpreter gives an uncaught ``SystemExit`` (printing a non-int code)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    try:
        print(e.code, file=sys.stderr)
    except BaseException:
        pass
    return 1


def main():
    os.umask(0o022)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # mirroring a crash must not dump a core here
    try:
        check(LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")
        if C["go_fd"] is not None:
            # the parent moves us into the call's cgroups while this interpreter starts (a cgroup migration
            # waits for an RCU grace period, ~10 ms); nothing may be forked before it says so
            go = os.read(C["go_fd"], 1)
            os.close(C["go_fd"])
            if go != b"1":
                raise OSError("the parent could not move the reaper into the call's cgroups")
        enter_namespaces()
        if C["fs"]:
            build_root()
        pid = os.fork()
    except BaseException as e:
        report("error=%r" % (e,))
        os._exit(C["setup_failed"])
    if pid == 0:
        child()
    reap(pid)


def reap(pid):
    """Drop root, wait for the child and leave with its exit status (a signal death is re-raised on us)."""
    os.close(INFO)
    if C["reaper_uid"] is not None:
        drop_to(C["reaper_uid"], C["reaper_uid"])
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status))


main()
