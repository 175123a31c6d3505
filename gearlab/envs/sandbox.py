"""Run untrusted, model-written Python code in a separate, restricted process.

``run(code, timeout_s=5.0, memory_mb=256) -> SandboxResult``

How the code is run
-------------------
``run`` writes the code to ``main.py`` and starts a small trusted *reaper* (``_sandbox_reaper.py``, run with
``python -I -S``: isolated mode, no site-packages) in a new session with a clean environment (only ``PATH``,
``HOME``, ``TMPDIR``, ``LANG``: no tokens, no ``MLFLOW_*``, no ``HF_*``). The reaper sets up the isolation
below and forks; the child finishes it (rlimits, uid drop, seccomp), closes every inherited fd and runs
``main.py`` in that same interpreter as ``python -I -S main.py`` would (fresh ``__main__``, same tracebacks
and exit status; no second interpreter start-up). The reaper waits and mirrors the child's exit status, so
the code's parent is the reaper, never the training process.

What this host supports is probed once per process (the first call costs ~0.5-1 s more): a trivial program
runs through each configuration, strongest first, and the first that works is used for every later call. Each
call *requires* every part of it: a call whose setup fails returns ``ok=False`` with ``error="sandbox setup
failed: ..."`` and never runs the code with less. The result's flags say what held: ``fs_isolated``,
``network_isolated``, ``pid_isolated``, ``privileges_dropped``, ``seccomp_filtered``, ``memory_cap``
(``oom_killed`` tells that the tree's memory cap killed a process).

Enforced always, root or not
  * wall-clock timeout, counted from the moment the code starts (setup gets ``SETUP_GRACE_S`` more): everything
    the call started is SIGKILLed, ``timed_out=True``;
  * rlimits per process: RLIMIT_CPU = ceil(timeout_s)+1 s, RLIMIT_AS = ``memory_mb`` MiB (a huge allocation
    raises ``MemoryError``), RLIMIT_FSIZE = 1 MiB per file, RLIMIT_NOFILE = 64, RLIMIT_CORE = 0,
    RLIMIT_NPROC = 32;
  * output cap: only the first ``OUTPUT_CAP`` (64 KiB) bytes of stdout / stderr are kept (marked truncated);
  * seccomp filter with no-new-privileges (x86_64 and aarch64; needs no privilege; ``seccomp_filtered``):
    ``unshare``, ``setns``, ``clone`` with any namespace flag, ``mount`` and the new mount API, ``umount2``,
    ``pivot_root``, ``chroot``, the kernel keyring (``add_key`` / ``keyctl`` / ``request_key``: a per-uid
    store that would outlive the call), ``bpf``, ``perf_event_open``, ``userfaultfd`` and ``io_uring_*`` fail
    with EPERM; ``clone3`` fails with ENOSYS (its flags sit in memory, out of a filter's reach; libc then falls
    back to ``clone``, so threads and ``fork`` work); an x32 syscall fails with ENOSYS and an i386 one
    (``int 0x80``) kills the process. So the code can create no namespace of any kind, user namespaces included;
  * clean-up: at the end (and on timeout) the process group, and every process of the call's session, pid
    namespace or cgroups, is SIGKILLed.

Enforced as root (the hardened path; it needs CAP_SYS_ADMIN and a kernel that lets root mount)
  * private filesystem (``fs_isolated``): its own mount namespace and a new root (``pivot_root``; the host's
    tree is detached). ``/`` is a read-only tmpfs holding read-only, nosuid, nodev bind mounts of only what the
    interpreter needs: its binary, its stdlib (with ``lib-dynload``), the directories of the shared libraries
    it and its stdlib extension modules load, the ELF loader path (all found once by a probe that imports
    every stdlib extension module) and ``/etc/ld.so.cache``. Nothing else of the host: no ``/etc/passwd``, no
    project, no ``runs/``, no task data, no ``/home``, ``/root`` (beyond the interpreter's own directories),
    ``/sys``, and no other program (no ``/bin/sh``: ``subprocess`` can start only the interpreter). Writable:
    one tmpfs of ``min(memory_mb, 64)`` MiB and 4096 inodes (nosuid, nodev, noexec) bound at ``/work`` (the
    cwd, holding ``main.py``), ``/tmp``, ``/var/tmp`` and ``/dev/shm``. ``/dev`` holds only null, zero, full,
    random, urandom and the fd links; ``/proc`` is a fresh procfs of the call's pid namespace (it lists only
    the call's processes). What the code writes lives in that tmpfs and is gone when the call ends: the kernel
    frees it with the mount namespace, the host never sees it;
  * namespaces: network (``network_isolated``: only a downed loopback, no connection at all, not even to
    127.0.0.1), pid (``pid_isolated``: the code is pid 1 of its own namespace, sees and signals nothing
    outside it, and when it exits the kernel kills whatever it left), IPC (System V shared memory and message
    queues die with the call), UTS and cgroup;
  * privilege drop (``privileges_dropped``): the code runs as a fresh uid/gid drawn per call from
    [``SANDBOX_UID_BASE``, ``SANDBOX_UID_BASE`` + ``SANDBOX_UID_COUNT``) with no supplementary groups, so
    RLIMIT_NPROC counts only this call's processes (concurrent calls do not share it) and one call cannot
    signal or ptrace another; the reaper itself drops to ``nobody`` after the fork;
  * one memory cap for the whole process tree (``memory_cap``): a cgroup per call, made under the caller's own
    cgroup, limits everything the tree uses together (all its processes, its tmpfs files, the reaper) to
    ``memory_mb`` MiB with no swap; going over gets a process of the tree OOM-killed (``oom_killed``).
    ``"cgroup-v2"`` where the caller's cgroup-v2 cgroup already delegates ``memory`` to its children (in its
    ``cgroup.subtree_control``), else ``"cgroup-v1"`` (the v1 memory hierarchy, when mounted and writable).
    The same v2 cgroup (when ``pids`` is delegated too) or a v1 pids cgroup (when that hierarchy is mounted)
    also caps the tree at ``NPROC_LIMIT`` tasks. With no usable cgroup it is ``"rlimit"``: the tree holds at
    most RLIMIT_NPROC = 32 processes (exactly, thanks to the fresh uid) of at most ``memory_mb`` MiB address
    space each: at most 32 x ``memory_mb`` MiB, plus the tmpfs above.

Where the machine gives no root (an unprivileged user; also root where namespaces or mounts are refused)
  * still enforced: the timeout, the rlimits, the output cap, the clean environment, the seccomp filter (so no
    user namespace either, hence no way to gain namespaces or mounts), the process-group / session clean-up;
  * NOT enforced: no private filesystem - the code reads everything the caller's uid can read (``/etc/passwd``,
    the project, ``runs/mlflow.db``, a task's data and answers) and writes wherever it can (``/tmp``,
    ``/dev/shm``, the project), files that outlive the call (each up to 1 MiB); no network isolation; no pid
    isolation - it sees every process in ``/proc`` and can signal every process of the caller's uid, the
    caller included; no privilege drop; RLIMIT_NPROC = 32 counts every process and thread of the caller's uid
    (a caller already running more than 32 makes every ``fork`` and thread start in the code fail); memory is
    bounded per process only (``memory_cap="rlimit"``: at most 32 x ``memory_mb`` MiB, less what the caller's
    uid already runs); a process that calls ``setsid()`` and double-forks can outlive the call (still bound by
    RLIMIT_CPU / RLIMIT_AS);
  * root where namespaces or mounts are refused: as above, except that the code runs as a fresh uid (it reads
    and writes only what "others" may; RLIMIT_NPROC counts only the call) if some interpreter is executable
    by such a uid, else as root (only the rlimits and the seccomp filter restrict it), and network / pid / IPC
    namespaces are used when the host allows them (the host's ``/proc`` then stays visible: it lists the host's
    processes, which the code cannot signal).

Not enforced anywhere: CPU time is limited per process, not per tree, and there is no CPU share (up to 32
busy processes for the whole timeout); side channels (timing, ``/proc/meminfo``, ``/proc/cpuinfo``) are out of
scope. See docs/sandbox.md.

This file imports nothing but the standard library and is one file on purpose (with ``_sandbox_reaper.py``): it can
be copied and run by another interpreter under another uid (tests/envs/test_sandbox.py runs it as ``nobody``).
"""
from __future__ import annotations

import errno
import functools
import itertools
import json
import marshal
import math
import os
import platform
import secrets
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = ["SandboxResult", "run", "OUTPUT_CAP"]

OUTPUT_CAP = 64 * 1024
FSIZE_LIMIT = 1024 * 1024
NOFILE_LIMIT = 64
NPROC_LIMIT = 32
SCRATCH_LIMIT_MB = 64
SCRATCH_INODES = 4096
SANDBOX_UID_BASE = 1_600_000_000  # far above any uid a distribution or directory service hands out
SANDBOX_UID_COUNT = 1 << 20
NOBODY_UID = 65534
SETUP_FAILED = 125
SETUP_GRACE_S = 10.0
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
_NS_FLAGS_FS = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
_NS_FLAGS_NO_FS = CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC
_PATH = "/usr/local/bin:/usr/bin:/bin"
_INTERPRETER_CANDIDATES = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")
_REAPER = str(Path(__file__).with_name("_sandbox_reaper.py"))
# host directories never exposed wholesale, whatever the library probe finds
_NEVER_EXPOSE = frozenset({"/", "/etc", "/home", "/root", "/tmp", "/var", "/var/tmp", "/dev", "/dev/shm", "/proc",
                           "/sys", "/run", "/mnt", "/media", "/srv", "/opt", "/usr", "/work"})
_PROBE_CODE = "import json, os, socket\nprint('ok')\n"
_MACHINE = platform.machine()

# --- seccomp -------------------------------------------------------------------------------------------------

_SECCOMP_ARCH = {  # machine: (AUDIT_ARCH_*, {syscall: nr})
    "x86_64": (0xC000003E, {
        "unshare": 272, "setns": 308, "clone": 56, "clone3": 435, "mount": 165, "umount2": 166, "pivot_root": 155,
        "chroot": 161, "add_key": 248, "request_key": 249, "keyctl": 250, "bpf": 321, "perf_event_open": 298,
        "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "mount_setattr": 442}),
    "aarch64": (0xC00000B7, {
        "unshare": 97, "setns": 268, "clone": 220, "clone3": 435, "mount": 40, "umount2": 39, "pivot_root": 41,
        "chroot": 51, "add_key": 217, "request_key": 218, "keyctl": 219, "bpf": 280, "perf_event_open": 241,
        "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "mount_setattr": 442}),
}
_SECCOMP_EPERM = ("unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "add_key", "request_key", "keyctl",
                  "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
                  "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr")
# every CLONE_NEW* bit that clone() accepts (CLONE_NEWTIME shares its bit with the exit signal there)
_CLONE_NS_MASK = (
    CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
)


def _seccomp_filter(machine: str | None = None) -> bytes | None:
    """The classic-BPF seccomp program (``struct sock_filter[]`` bytes) described in the module docstring, or None
    for a machine whose syscall table is not known here."""
    machine = machine or _MACHINE
    if machine not in _SECCOMP_ARCH:
        return None
    arch, nr = _SECCOMP_ARCH[machine]
    ld_abs, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, kill, errno_ret = 0x7FFF0000, 0x80000000, 0x00050000
    prog: list[list] = []  # [code, jt, jf, k]; jt / jf may be labels until resolved
    labels: dict[str, int] = {}

    def emit(code: int, k: int, jt: int | str = 0, jf: int | str = 0) -> None:
        prog.append([code, jt, jf, k])

    emit(ld_abs, 4)  # seccomp_data.arch
    emit(jeq, arch, 1, 0)
    emit(ret, kill)
    emit(ld_abs, 0)  # seccomp_data.nr
    if machine == "x86_64":
        emit(jge, 0x40000000, "enosys")  # the x32 ABI (__X32_SYSCALL_BIT)
    for name in _SECCOMP_EPERM:
        emit(jeq, nr[name], "eperm")
    emit(jeq, nr["clone3"], "enosys")
    emit(jeq, nr["clone"], "clone")
    emit(ret, allow)
    labels["clone"] = len(prog)
    emit(ld_abs, 16)  # low 32 bits of args[0] (little-endian): the clone flags
    emit(jset, _CLONE_NS_MASK, "eperm")
    emit(ret, allow)
    labels["eperm"] = len(prog)
    emit(ret, errno_ret | errno.EPERM)
    labels["enosys"] = len(prog)
    emit(ret, errno_ret | errno.ENOSYS)
    out = bytearray()
    for i, (code, jt, jf, k) in enumerate(prog):
        jt = labels[jt] - i - 1 if isinstance(jt, str) else jt
        jf = labels[jf] - i - 1 if isinstance(jf, str) else jf
        out += struct.pack("<HBBI", code, jt, jf, k)
    return bytes(out)


# --- the private root's read-only view -----------------------------------------------------------------------

_LIBS_PROBE = r"""
import json, os, sys
for d in sys.path:
    if os.path.basename(d) == "lib-dynload" and os.path.isdir(d):
        for n in sorted(os.listdir(d)):
            if n.endswith(".so"):
                try:
                    __import__(n.split(".")[0])
                except BaseException:
                    pass
files = set()
with open("/proc/self/maps") as f:
    for line in f:
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/") and not parts[5].rstrip().endswith("(deleted)"):
            files.add(parts[5].rstrip("\n"))
print(json.dumps({"stdlib": os.path.dirname(os.__file__), "files": sorted(files)}))
"""


def _elf_interp(path: str) -> str | None:
    """The PT_INTERP (dynamic loader) path of an ELF executable, or None (static, or not ELF)."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF":
            return None
        is64, endian = head[4] == 2, "<" if head[5] == 1 else ">"
        if is64:
            phoff, = struct.unpack_from(endian + "Q", head, 32)
            phentsize, phnum = struct.unpack_from(endian + "HH", head, 54)
        else:
            phoff, = struct.unpack_from(endian + "I", head, 28)
            phentsize, phnum = struct.unpack_from(endian + "HH", head, 42)
        for i in range(phnum):
            f.seek(phoff + i * phentsize)
            ph = f.read(phentsize)
            if struct.unpack_from(endian + "I", ph, 0)[0] != 3:  # PT_INTERP
                continue
            if is64:
                offset, = struct.unpack_from(endian + "Q", ph, 8)
                size, = struct.unpack_from(endian + "Q", ph, 32)
            else:
                offset, = struct.unpack_from(endian + "I", ph, 4)
                size, = struct.unpack_from(endian + "I", ph, 16)
            f.seek(offset)
            return f.read(size).rstrip(b"\0").decode()
    return None


def _covered(path: str, binds: list[str]) -> bool:
    return any(path == b or path.startswith(b.rstrip("/") + "/") for b in binds)


def _expose(path: str, ops: list[tuple], binds: list[str], made: set[str]) -> None:
    """Append the ops that make host ``path`` resolve to the same file inside the new root: a directory for
    each plain path component, the same symlink for each symlink component (then its target is exposed too),
    and a read-only bind of the last one."""
    for _ in range(40):  # symlink hops
        parts = [p for p in os.path.normpath(path).split("/") if p]
        cur = ""
        for i, name in enumerate(parts):
            cur += "/" + name
            rest = parts[i + 1:]
            if os.path.islink(cur):
                target = os.readlink(cur)
                if not _covered(cur, binds) and cur not in made:
                    ops.append(("link", cur, target))
                    made.add(cur)
                base = target if target.startswith("/") else os.path.join(os.path.dirname(cur), target)
                path = os.path.join(base, *rest)
                break
            if _covered(cur, binds):
                continue
            if not rest:
                if not os.path.exists(cur):
                    raise FileNotFoundError(cur)
                ops.append(("bind", cur))
                binds.append(cur)
            elif cur not in made:
                ops.append(("dir", cur))
                made.add(cur)
        else:
            return
    raise OSError(errno.ELOOP, f"too many symlinks resolving {path}")


@functools.lru_cache(maxsize=8)
def _fs_plan(interpreter: str) -> tuple[tuple, ...]:
    """The ops that build the new root's read-only view for ``interpreter`` (see the module docstring)."""
    r = subprocess.run([interpreter, "-I", "-S", "-c", _LIBS_PROBE], capture_output=True, timeout=60,
                       env={"PATH": _PATH, "LANG": "C.UTF-8"}, cwd="/", stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise OSError(f"library probe failed: {r.stderr.decode(errors='replace')[-300:]}")
    found = json.loads(r.stdout.decode().strip().splitlines()[-1])  # a module may print on import
    real = os.path.realpath(interpreter)
    wanted = {interpreter, found["stdlib"]}
    loader = _elf_interp(real)
    if loader:
        wanted.add(loader)
    for f in found["files"]:
        if os.path.realpath(f) != real:
            wanted.add(os.path.dirname(f))
    if os.path.isfile("/etc/ld.so.cache"):
        wanted.add("/etc/ld.so.cache")
    too_wide = sorted(p for p in wanted if os.path.normpath(p) in _NEVER_EXPOSE)
    if too_wide:
        raise ValueError(f"refusing to expose {too_wide} read-only to sandboxed code")
    ops: list[tuple] = []
    binds: list[str] = []
    made: set[str] = set()
    for p in sorted(wanted, key=lambda p: (len(p), p)):  # parents before children
        _expose(p, ops, binds, made)
    return tuple(ops)


# --- cgroups -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _CgroupBackend:
    """Where per-call cgroups are made: a v2 parent, or v1 memory (+ pids) parents."""
    kind: str  # "cgroup-v2" | "cgroup-v1"
    memory_parent: str
    pids_parent: str | None


_cg_counter = itertools.count()
_stale_cgroups: list[str] = []
_stale_lock = threading.Lock()


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _cg_dir(mountpoint: str, mount_root: str, path: str) -> str | None:
    """The directory of cgroup ``path`` (from /proc/self/cgroup) under a mount of that hierarchy."""
    if mount_root == "/":
        return os.path.normpath(mountpoint + path)
    if path == mount_root or path.startswith(mount_root.rstrip("/") + "/"):
        return os.path.normpath(mountpoint + path[len(mount_root):])
    return None


def _cgroup_backend() -> _CgroupBackend | None:
    """A cgroup parent this process can create per-call children in, with a working memory limit; else None."""
    try:
        with open("/proc/self/cgroup") as f:
            own = {}
            for line in f:
                _, ctrls, path = line.rstrip("\n").split(":", 2)
                for c in ctrls.split(",") if ctrls else [""]:
                    own[c] = path
        mounts = []
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rfields = left.split(), right.split()
                mounts.append((fields[4], fields[3], rfields[0], rfields[2].split(",")))
    except (OSError, ValueError, IndexError):
        return None
    candidates = []
    for mp, root, fstype, _ in mounts:
        if fstype == "cgroup2" and "" in own:
            d = _cg_dir(mp, root, own[""])
            try:
                with open(os.path.join(d or "/nonexistent", "cgroup.subtree_control")) as f:
                    ctrls = f.read().split()
            except OSError:
                ctrls = []
            if "memory" in ctrls:
                candidates.append(_CgroupBackend("cgroup-v2", d, None))
    mem = next(((mp, root) for mp, root, fs, opts in mounts if fs == "cgroup" and "memory" in opts), None)
    pids = next(((mp, root) for mp, root, fs, opts in mounts if fs == "cgroup" and "pids" in opts), None)
    if mem and "memory" in own:
        d = _cg_dir(mem[0], mem[1], own["memory"])
        pd = _cg_dir(pids[0], pids[1], own["pids"]) if pids and "pids" in own else None
        if d:
            candidates.append(_CgroupBackend("cgroup-v1", d, pd))
    for cand in candidates:
        try:
            probe = _CallCgroups(cand, 64 << 20, NPROC_LIMIT)
        except OSError:
            continue
        probe.remove()
        _sweep_stale_cgroups(cand)
        return cand
    return None


def _sweep_stale_cgroups(backend: _CgroupBackend) -> None:
    """Remove the empty per-call cgroups that a dead process left behind (named gearlab-sandbox-PID-...): only
    those older than a minute, since a parent may be shared with processes of another pid namespace."""
    for parent in filter(None, (backend.memory_parent, backend.pids_parent)):
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            parts = name.split("-")
            if len(parts) < 4 or parts[:2] != ["gearlab", "sandbox"] or not parts[2].isdigit():
                continue
            path = os.path.join(parent, name)
            try:
                if os.path.exists(f"/proc/{parts[2]}") or time.time() - os.stat(path).st_mtime < 60:
                    continue
                os.rmdir(path)  # fails, harmlessly, while it holds a process
            except OSError:
                pass


class _CallCgroups:
    """The cgroup(s) of one call: created with the limits, joined by the reaper, emptied and removed at the end."""

    def __init__(self, backend: _CgroupBackend, mem_bytes: int, nproc: int) -> None:
        self.backend = backend
        self.dirs: list[str] = []
        name = f"gearlab-sandbox-{os.getpid()}-{next(_cg_counter)}-{secrets.token_hex(3)}"
        try:
            mem = os.path.join(backend.memory_parent, name)
            os.mkdir(mem)
            self.dirs.append(mem)
            if backend.kind == "cgroup-v2":
                _write(os.path.join(mem, "memory.max"), str(mem_bytes))
                for fname, value in (("memory.swap.max", "0"), ("pids.max", str(nproc))):
                    if os.path.exists(os.path.join(mem, fname)):
                        _write(os.path.join(mem, fname), value)
            else:
                _write(os.path.join(mem, "memory.limit_in_bytes"), str(mem_bytes))
                try:  # memory + swap (absent when the kernel accounts no swap)
                    _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(mem_bytes))
                except OSError:
                    pass
                if backend.pids_parent:
                    pids = os.path.join(backend.pids_parent, name)
                    os.mkdir(pids)
                    self.dirs.append(pids)
                    _write(os.path.join(pids, "pids.max"), str(nproc))
        except BaseException:
            self.remove()
            raise

    def join(self, pid: int) -> None:
        """Move process ``pid`` (not yet forked: its children are born inside) into every cgroup of the call."""
        for d in self.dirs:
            _write(os.path.join(d, "cgroup.procs"), str(pid))

    def procs(self) -> list[int]:
        found: set[int] = set()
        for d in self.dirs:
            try:
                with open(os.path.join(d, "cgroup.procs")) as f:
                    found.update(int(x) for x in f.read().split())
            except (OSError, ValueError):
                pass
        return sorted(found)

    def oom_kills(self) -> int:
        fname = "memory.events" if self.backend.kind == "cgroup-v2" else "memory.oom_control"
        try:
            with open(os.path.join(self.dirs[0], fname)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError, IndexError):
            pass
        return 0

    def kill(self) -> None:
        for _ in range(200):
            pids = self.procs()
            if not pids:
                return
            _sigkill(pids)
            time.sleep(0.001)

    def remove(self) -> None:
        """rmdir the call's cgroups (retrying while a killed task finishes exiting), and once more those an
        earlier call had to leave behind."""
        with _stale_lock:
            stale = list(_stale_cgroups)
            _stale_cgroups.clear()
        left = [d for d in stale if not _rmdir(d, attempts=1)]
        left += [d for d in self.dirs if not _rmdir(d, attempts=100)]
        if left:
            with _stale_lock:
                _stale_cgroups.extend(left)


def _rmdir(path: str, attempts: int) -> bool:
    """Remove an (empty) cgroup directory; False if it stayed busy for all ``attempts`` (2 ms apart)."""
    for attempt in range(attempts):
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if attempt + 1 < attempts:
                time.sleep(0.002)
    return False


# --- what this host supports ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Mode:
    interpreter: str
    drop: bool  # run the code as a fresh uid (needs root)
    fs: bool  # private mount namespace and root
    ns_flags: int  # namespaces the reaper enters
    ns_required: bool
    plan: tuple = ()
    cgroup: _CgroupBackend | None = None
    seccomp: bytes | None = None


def _drop_to_probe_uid() -> None:
    os.setgroups([])
    os.setgid(SANDBOX_UID_BASE)
    os.setuid(SANDBOX_UID_BASE)


def _interpreter_for_unprivileged_uid() -> str | None:
    """An interpreter (preferably ``sys.executable``) that an unprivileged uid can run on the host; else None."""
    seen = []
    for cand in (sys.executable, *_INTERPRETER_CANDIDATES):
        if not cand or not os.path.exists(cand) or os.path.realpath(cand) in seen:
            continue
        seen.append(os.path.realpath(cand))
        try:
            r = subprocess.run([cand, "-I", "-S", "-c", _PROBE_CODE], capture_output=True, timeout=10,
                               env={"PATH": _PATH}, cwd="/", preexec_fn=_drop_to_probe_uid)
        except (OSError, subprocess.SubprocessError):
            continue
        if r.returncode == 0 and r.stdout.strip() == b"ok":
            return cand
    return None


def _candidate_modes() -> list[_Mode]:
    """Configurations to try, strongest first."""
    cg = _cgroup_backend()
    bpf = _seccomp_filter()
    if os.geteuid() != 0:
        base = [_Mode(sys.executable, drop=False, fs=False, ns_flags=0, ns_required=False)]
    else:
        base = []
        seen = set()
        for cand in (os.path.realpath(sys.executable) if sys.executable else "", *_INTERPRETER_CANDIDATES):
            if not cand or not os.path.exists(cand) or os.path.realpath(cand) in seen:
                continue
            seen.add(os.path.realpath(cand))
            try:
                plan = _fs_plan(cand)
            except (OSError, ValueError, subprocess.SubprocessError):
                continue
            base.append(_Mode(cand, drop=True, fs=True, ns_flags=_NS_FLAGS_FS, ns_required=True, plan=plan))
        host_interp = _interpreter_for_unprivileged_uid()
        if host_interp:
            base.append(_Mode(host_interp, drop=True, fs=False, ns_flags=_NS_FLAGS_NO_FS, ns_required=False))
        base.append(_Mode(sys.executable, drop=False, fs=False, ns_flags=_NS_FLAGS_NO_FS, ns_required=False))
    out = []
    for m in base:
        for variant in (replace(m, cgroup=cg, seccomp=bpf), replace(m, seccomp=bpf), replace(m, cgroup=cg), m):
            if variant not in out:
                out.append(variant)
    return out


_mode_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def _probed_mode() -> _Mode:
    candidates = _candidate_modes()
    failures = []
    for m in candidates:
        for _ in range(2):  # a second chance for a probe that only ran out of time on a busy machine
            r = _run(m, _PROBE_CODE, timeout_s=10.0, memory_mb=256)
            if r.ok and r.stdout == "ok\n":
                if os.geteuid() == 0 and not m.fs:
                    warnings.warn("gearlab sandbox: running as root, but the hardened path (private filesystem, "
                                  f"namespaces) does not work here, so model code runs with less isolation: "
                                  f"{'; '.join(failures) or 'no interpreter could be exposed'}", RuntimeWarning)
                return m
            if not r.timed_out:
                break
        failures.append(f"{'fs' if m.fs else 'no fs'}/{m.interpreter}: {r.error}")
    return candidates[-1]


def _mode() -> _Mode:
    """The strongest configuration that really works here (each candidate runs a probe program), found once."""
    with _mode_lock:  # the rollout's step workers call run() concurrently: probe once, not once per thread
        return _probed_mode()


# --- running one call ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SandboxResult:
    ok: bool
    stdout: str
    stderr: str
    error: str | None
    timed_out: bool
    returncode: int | None
    wall_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    network_isolated: bool = False
    pid_isolated: bool = False
    privileges_dropped: bool = False
    interpreter: str = ""
    fs_isolated: bool = False
    seccomp_filtered: bool = False
    memory_cap: str = "rlimit"  # "cgroup-v2" | "cgroup-v1" | "rlimit" (see the module docstring)
    oom_killed: bool = False


def _reader(fd: int, cap: int, out: dict) -> None:
    head = bytearray()
    total = 0
    try:
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            total += len(chunk)
            if len(head) < cap:
                head += chunk[: cap - len(head)]
    except OSError:
        pass
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    out["head"] = bytes(head)
    out["total"] = total


def _decode(state: dict, cap: int) -> tuple[str, bool]:
    head = state.get("head", b"")
    total = state.get("total", len(head))
    text = head.decode("utf-8", errors="replace")
    if total > cap:
        text += f"\n...[truncated: {total} bytes written, first {cap} kept]"
        return text, True
    return text, False


def _read_info(fd: int, deadline: float) -> dict[str, str]:
    """The reaper's ``key=value`` progress lines, up to ``started`` (the code runs now) or ``error``. Not up to
    EOF: a process the caller forks meanwhile may hold a copy of the pipe's write end."""
    buf = bytearray()
    info: dict[str, str] = {}
    try:
        while "started" not in info and "error" not in info:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                break
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buf += chunk
            *lines, rest = buf.split(b"\n")
            buf = bytearray(rest)
            for line in lines:
                key, _, value = line.decode("utf-8", "replace").partition("=")
                info[key] = value
    finally:
        os.close(fd)
    return info


def _sigkill(pids) -> None:
    """SIGKILL each pid; one already gone (or no longer ours to signal) is skipped."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _procs_to_kill(pgid: int, pidns: str | None) -> list[int]:
    """Pids still in the child's session/process group, or in its pid namespace."""
    found = []
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid == me:
            continue
        try:
            if pidns is not None and os.readlink(f"/proc/{pid}/ns/pid") == pidns:
                found.append(pid)
                continue
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            fields = stat[stat.rindex(b")") + 2:].split()
            # fields[0]=state, [1]=ppid, [2]=pgrp, [3]=session
            if int(fields[2]) == pgid or int(fields[3]) == pgid:
                found.append(pid)
        except (OSError, ValueError, IndexError):
            continue
    return found


def _kill_all(pgid: int, pidns: str | None, cgroups: _CallCgroups | None) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if cgroups is not None:
        cgroups.kill()
        if pidns is not None:  # no member can leave the cgroup: it lists the whole tree
            return
    for _ in range(3):
        pids = _procs_to_kill(pgid, pidns)
        if not pids:
            return
        _sigkill(pids)
        time.sleep(0.01)


def _error_text(timed_out: bool, timeout_s: float, rc: int | None, stderr: str, oom: bool) -> str | None:
    if timed_out:
        return f"timed out after {timeout_s} s"
    if rc == 0:
        return None
    if rc is not None and rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = "?"
        extra = ""
        if -rc == signal.SIGXCPU:
            extra = " (CPU time limit)"
        elif -rc == signal.SIGXFSZ:
            extra = " (file size limit)"
        elif -rc == signal.SIGKILL and oom:
            extra = " (memory limit)"
        return f"killed by signal {-rc} ({name}){extra}"
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and not ln.startswith("...[truncated")]
    if lines:
        return lines[-1][:500]
    return f"exited with code {rc}"


def _wait(proc: subprocess.Popen, timeout: float) -> int:
    """``proc.wait(timeout)``, but woken through a pidfd the moment the process exits (``Popen.wait`` with a
    timeout polls, sleeping up to 50 ms between looks)."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        return proc.wait(timeout=max(0.0, timeout))
    try:
        if not select.select([fd], [], [], max(0.0, timeout))[0]:
            raise subprocess.TimeoutExpired(proc.args, timeout)
    finally:
        os.close(fd)
    return proc.wait()


def _prepare_workspace(base: str, code: str, mode: _Mode, uid: int | None) -> tuple[str, dict[str, str]]:
    """Write ``code`` into the call's private folder ``base``; (path of main.py, the child's environment)."""
    os.chmod(base, 0o700)
    main_py = os.path.join(base, "main.py")
    with open(main_py, "w", encoding="utf-8") as f:
        f.write(code)
    if mode.fs:  # the reaper builds a new root from these two folders; the code sees /work and /tmp there
        os.mkdir(os.path.join(base, "root"))
        os.mkdir(os.path.join(base, "scratch"))
        home, tmp = "/work", "/tmp"
    else:
        home = tmp = base
        if uid is not None:
            os.chown(base, uid, uid)
            os.chown(main_py, uid, uid)
    return main_py, {"PATH": _PATH, "HOME": home, "TMPDIR": tmp, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}


def _reaper_config(mode: _Mode, base: str, main_py: str, uid: int | None, timeout_s: float, memory_mb: int,
                   info_fd: int, go_fd: int | None) -> dict:
    """What the reaper process is told (marshalled on its command line): namespaces, file system plan, limits."""
    rlimits = [("RLIMIT_CPU", int(math.ceil(timeout_s)) + 1), ("RLIMIT_AS", int(memory_mb) * 1024 * 1024),
               ("RLIMIT_FSIZE", FSIZE_LIMIT), ("RLIMIT_NOFILE", NOFILE_LIMIT), ("RLIMIT_CORE", 0),
               ("RLIMIT_NPROC", NPROC_LIMIT)]
    return {
        "info_fd": info_fd, "go_fd": go_fd, "ns_flags": mode.ns_flags,
        "ns_required": mode.ns_required, "fs": mode.fs, "root": os.path.join(base, "root"),
        "scratch": os.path.join(base, "scratch"), "scratch_bytes": min(int(memory_mb), SCRATCH_LIMIT_MB) << 20,
        "scratch_inodes": SCRATCH_INODES, "main": main_py, "plan": [list(op) for op in mode.plan],
        "uid": uid, "gid": uid, "reaper_uid": NOBODY_UID if mode.drop else None, "rlimits": rlimits,
        "seccomp": mode.seccomp, "cwd": "/work" if mode.fs else base,
        "main_path": "/work/main.py" if mode.fs else main_py,
        "setup_failed": SETUP_FAILED,
        "nr_pivot_root": _SECCOMP_ARCH.get(_MACHINE, (0, {}))[1].get("pivot_root", -1),
    }


def _run(mode: _Mode, code: str, timeout_s: float, memory_mb: int) -> SandboxResult:
    """One call under ``mode``."""
    mem = int(memory_mb) * 1024 * 1024
    uid = SANDBOX_UID_BASE + secrets.randbelow(SANDBOX_UID_COUNT) if mode.drop else None
    out_state: dict = {}
    err_state: dict = {}
    timed_out = False
    rc: int | None = None
    info: dict[str, str] = {}
    cgroups: _CallCgroups | None = None
    oom = False
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gearlab-sandbox-") as base:
        main_py, env = _prepare_workspace(base, code, mode, uid)
        try:
            if mode.cgroup is not None:
                cgroups = _CallCgroups(mode.cgroup, mem, NPROC_LIMIT)
        except OSError as e:
            return SandboxResult(ok=False, stdout="", stderr="", error=f"sandbox setup failed: cgroup: {e}",
                                 timed_out=False, returncode=None, wall_s=time.monotonic() - t0,
                                 interpreter=mode.interpreter)
        info_r, info_w = os.pipe()
        go_r, go_w = os.pipe() if cgroups is not None else (None, None)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        config = _reaper_config(mode, base, main_py, uid, timeout_s, memory_mb, info_w, go_r)
        try:
            try:
                proc = subprocess.Popen([mode.interpreter, "-I", "-S", _REAPER, marshal.dumps(config).hex()],
                                        cwd=base, env=env,
                                        stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w, close_fds=True,
                                        pass_fds=(info_w,) if go_r is None else (info_w, go_r),
                                        start_new_session=True)
            except BaseException:
                for fd in (out_r, err_r, info_r, go_w):
                    if fd is not None:
                        os.close(fd)
                raise
            finally:
                for fd in (out_w, err_w, info_w, go_r):
                    if fd is not None:
                        os.close(fd)
            pidns = None
            try:
                if cgroups is not None:
                    try:
                        cgroups.join(proc.pid)
                        go = b"1"
                    except OSError:
                        go = b"0"  # the reaper reports the failure and runs nothing
                    try:
                        os.write(go_w, go)
                    except OSError:
                        pass  # the reaper is gone already; its exit status tells
                    finally:
                        os.close(go_w)
                threads = [threading.Thread(target=_reader, args=(out_r, OUTPUT_CAP, out_state), daemon=True),
                           threading.Thread(target=_reader, args=(err_r, OUTPUT_CAP, err_state), daemon=True)]
                for t in threads:
                    t.start()
                # the timeout is the code's own: it starts when the code does (setup gets SETUP_GRACE_S more)
                info = _read_info(info_r, time.monotonic() + timeout_s + SETUP_GRACE_S)
                started = time.monotonic()
                if info.get("pid") == "1":
                    try:
                        pidns = os.readlink(f"/proc/{proc.pid}/ns/pid_for_children")
                    except OSError:
                        pidns = None
                try:
                    rc = _wait(proc, 5.0 if "error" in info else started + timeout_s - time.monotonic())
                except subprocess.TimeoutExpired:
                    timed_out = True
            finally:
                _kill_all(proc.pid, pidns, cgroups)
            rc = proc.wait() if timed_out or rc is None else rc
            for t in threads:
                t.join(timeout=2.0)
            oom = cgroups is not None and cgroups.oom_kills() > 0
        finally:
            if cgroups is not None:
                cgroups.remove()
        wall = time.monotonic() - t0
    stdout, out_trunc = _decode(out_state, OUTPUT_CAP)
    stderr, err_trunc = _decode(err_state, OUTPUT_CAP)
    error = _error_text(timed_out, timeout_s, rc, stderr, oom)
    if "error" in info:
        error = f"sandbox setup failed: {info['error']}"
    return SandboxResult(
        ok=(rc == 0 and not timed_out and "error" not in info),
        stdout=stdout, stderr=stderr, error=error,
        timed_out=timed_out, returncode=rc, wall_s=wall,
        stdout_truncated=out_trunc, stderr_truncated=err_trunc,
        network_isolated=info.get("net") == "1", pid_isolated=info.get("pid") == "1",
        privileges_dropped=uid is not None, interpreter=mode.interpreter,
        fs_isolated=info.get("fs") == "1", seccomp_filtered=info.get("seccomp") == "1",
        memory_cap=mode.cgroup.kind if cgroups is not None else "rlimit", oom_killed=oom,
    )


def run(code: str, timeout_s: float = 5.0, memory_mb: int = 256) -> SandboxResult:
    """Run ``code`` in a separate restricted process; see the module docstring for what is enforced."""
    return _run(_mode(), code, timeout_s, memory_mb)
