"""Run untrusted, model-written Python code in a separate, restricted process.

``run(code, timeout_s=5.0, memory_mb=256) -> SandboxResult``

How the code is run
-------------------
The code is written to ``main.py`` in a fresh, empty temporary directory (removed afterwards)
and started with ``python -I -S`` (isolated mode, no site-packages) in a new session
(``start_new_session=True``), with a clean environment (only ``PATH``, ``HOME``/``TMPDIR`` = the
temp dir, ``LANG``; nothing inherited: no tokens, no ``MLFLOW_*``, no ``HF_*``). The exec'd
process is a tiny trusted *reaper*: it forks and execs the user's code in the child, waits for it
and mirrors its exit status.  So ``os.getppid()`` in the user's code is the reaper, never the
training process.

Enforced (always)
  * wall-clock timeout: the whole process group is SIGKILLed, ``timed_out=True``;
  * rlimits set in ``preexec_fn``: RLIMIT_CPU = ceil(timeout_s)+1 s, RLIMIT_AS = ``memory_mb`` MiB
    (so huge allocations raise ``MemoryError``), RLIMIT_FSIZE = 1 MiB per file, RLIMIT_NOFILE = 64,
    RLIMIT_CORE = 0, RLIMIT_NPROC = 32;
  * output cap: stdout/stderr are read through pipes, only the first ``OUTPUT_CAP`` (64 KiB) bytes of
    each are kept, the rest is drained and discarded; truncation is marked in the text;
  * clean-up: at the end (and on timeout) the process group is SIGKILLed, and so is every process
    still in the child's session or (below) its pid namespace.

Enforced only when the parent runs as root (``privileges_dropped`` / ``network_isolated`` /
``pid_isolated`` in the result tell what actually happened):
  * network namespace (``unshare(CLONE_NEWNET)`` via libc): the code sees only a downed loopback,
    so no connection at all, not even to 127.0.0.1;
  * pid namespace (``unshare(CLONE_NEWPID)``): the user's code is pid 1 of its own namespace, cannot
    see or signal any process outside it (``kill(-1, ...)`` included), and when it exits the kernel
    kills every process it left behind; the parent also SIGKILLs any process in that namespace;
  * privilege drop to ``nobody`` (uid/gid 65534, no supplementary groups) - only if an interpreter
    exists that ``nobody`` can execute (``sys.executable`` if accessible, else ``/usr/bin/python3``
    etc.; probed once).  Then the code cannot read root-only files, write to root-owned
    directories, or signal root processes, and RLIMIT_NPROC is actually enforced (Linux ignores it
    for root), which stops fork bombs.

NOT enforced
  * without root: no network or pid isolation, no privilege drop; RLIMIT_NPROC is enforced only
    against the (shared) uid of the caller; a process that calls ``setsid()`` could outlive the run
    (it is still bound by RLIMIT_CPU/AS). If running as root but no interpreter is usable by
    ``nobody``, the code runs as root: it can read/write anything root can (only rlimits, the pid and
    network namespaces restrict it) and RLIMIT_NPROC is not enforced (the pid namespace + process
    group kill + timeout still bound a fork bomb).
  * no filesystem isolation (no mount namespace / chroot): as ``nobody`` the code can still read
    world-readable files and write to world-writable places such as ``/tmp`` (up to 1 MiB a file).
  * no seccomp syscall filter; no cgroup (RLIMIT_AS limits address space per process, not total
    memory of all processes; RLIMIT_NPROC for ``nobody`` counts all ``nobody`` processes on the host).
  * CPU time is limited per process; wall time for the whole run.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

__all__ = ["SandboxResult", "run", "OUTPUT_CAP"]

OUTPUT_CAP = 64 * 1024
FSIZE_LIMIT = 1024 * 1024
NOFILE_LIMIT = 64
NPROC_LIMIT = 32
NOBODY_UID = 65534
NOBODY_GID = 65534
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
_PATH = "/usr/local/bin:/usr/bin:/bin"
_INTERPRETER_CANDIDATES = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")

# The trusted reaper: fork, exec the user's code in the child, mirror its exit status.
_REAPER = r"""
import os, signal, sys
pid = os.fork()
if pid == 0:
    try:
        os.execv(sys.executable, [sys.executable, "-I", "-S", "main.py"])
    finally:
        os._exit(127)
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
"""


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


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _drop_privileges() -> None:
    os.setgroups([])
    os.setgid(NOBODY_GID)
    os.setuid(NOBODY_UID)


@functools.lru_cache(maxsize=1)
def _interpreter_for_nobody() -> str | None:
    """An interpreter (preferably ``sys.executable``) that uid ``nobody`` can run with its stdlib; else None."""
    if os.geteuid() != 0:
        return None
    seen = []
    for cand in (sys.executable, *_INTERPRETER_CANDIDATES):
        if not cand or not os.path.exists(cand):
            continue
        real = os.path.realpath(cand)
        if real in seen:
            continue
        seen.append(real)
        try:
            r = subprocess.run([cand, "-I", "-S", "-c", "import json, os, socket; print('ok')"],
                               capture_output=True, timeout=10, env={"PATH": _PATH}, cwd="/",
                               preexec_fn=_drop_privileges)
        except (OSError, subprocess.SubprocessError):
            continue
        if r.returncode == 0 and r.stdout.strip() == b"ok":
            return cand
    return None


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


def _kill_all(pgid: int, pidns: str | None) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for _ in range(3):
        pids = _procs_to_kill(pgid, pidns)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)


def _error_text(timed_out: bool, timeout_s: float, rc: int | None, stderr: str) -> str | None:
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
        return f"killed by signal {-rc} ({name}){extra}"
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and not ln.startswith("...[truncated")]
    if lines:
        return lines[-1][:500]
    return f"exited with code {rc}"


def run(code: str, timeout_s: float = 5.0, memory_mb: int = 256) -> SandboxResult:
    """Run ``code`` in a separate restricted process; see the module docstring for what is enforced."""
    is_root = os.geteuid() == 0
    interpreter = _interpreter_for_nobody() if is_root else None
    drop = interpreter is not None
    if interpreter is None:
        interpreter = sys.executable
    cpu_s = int(math.ceil(timeout_s)) + 1
    mem = int(memory_mb) * 1024 * 1024
    flags = {"net": False, "pid": False}
    # pipe written by preexec_fn to report which namespaces were created
    info_r, info_w = os.pipe()

    def preexec() -> None:
        os.close(info_r)
        net = pid = False
        if is_root:
            libc = _libc()
            if libc.unshare(CLONE_NEWNET | CLONE_NEWPID) == 0:
                net = pid = True
            else:
                net = libc.unshare(CLONE_NEWNET) == 0
                pid = libc.unshare(CLONE_NEWPID) == 0
        os.write(info_w, bytes([int(net), int(pid)]))
        os.close(info_w)
        for res, lim in ((resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_AS, mem),
                         (resource.RLIMIT_FSIZE, FSIZE_LIMIT), (resource.RLIMIT_NOFILE, NOFILE_LIMIT),
                         (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, NPROC_LIMIT)):
            try:
                resource.setrlimit(res, (lim, lim))
            except (ValueError, OSError):
                pass
        if drop:
            _drop_privileges()

    out_state: dict = {}
    err_state: dict = {}
    timed_out = False
    rc: int | None = None
    with tempfile.TemporaryDirectory(prefix="gearlab-sandbox-") as work:
        with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        if drop:
            os.chown(work, NOBODY_UID, NOBODY_GID)
            os.chown(os.path.join(work, "main.py"), NOBODY_UID, NOBODY_GID)
        os.chmod(work, 0o700)
        env = {"PATH": _PATH, "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen([interpreter, "-I", "-S", "-c", _REAPER], cwd=work, env=env,
                                    stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w,
                                    close_fds=True, pass_fds=(info_w,), start_new_session=True,
                                    preexec_fn=preexec)
        except BaseException:
            for fd in (out_r, out_w, err_r, err_w, info_r, info_w):
                os.close(fd)
            raise
        os.close(out_w)
        os.close(err_w)
        os.close(info_w)
        try:
            got = os.read(info_r, 2)
        finally:
            os.close(info_r)
        if len(got) == 2:
            flags["net"], flags["pid"] = bool(got[0]), bool(got[1])
        pidns = None
        if flags["pid"]:
            try:
                pidns = os.readlink(f"/proc/{proc.pid}/ns/pid_for_children")
            except OSError:
                pidns = None
        threads = [threading.Thread(target=_reader, args=(out_r, OUTPUT_CAP, out_state), daemon=True),
                   threading.Thread(target=_reader, args=(err_r, OUTPUT_CAP, err_state), daemon=True)]
        for t in threads:
            t.start()
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_all(proc.pid, pidns)
        if timed_out:
            rc = proc.wait()
        for t in threads:
            t.join(timeout=2.0)
        wall = time.monotonic() - t0
    stdout, out_trunc = _decode(out_state, OUTPUT_CAP)
    stderr, err_trunc = _decode(err_state, OUTPUT_CAP)
    return SandboxResult(
        ok=(rc == 0 and not timed_out),
        stdout=stdout, stderr=stderr,
        error=_error_text(timed_out, timeout_s, rc, stderr),
        timed_out=timed_out, returncode=rc, wall_s=wall,
        stdout_truncated=out_trunc, stderr_truncated=err_trunc,
        network_isolated=flags["net"], pid_isolated=flags["pid"], privileges_dropped=drop, interpreter=interpreter,
    )
