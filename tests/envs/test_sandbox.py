"""Tests for gearlab.envs.sandbox: each case runs real child processes with small timeouts.

As root (here and in CI) the hardened path is exercised and every escape is really attempted: reading host files,
listing host processes, leaving files in /tmp, /var/tmp and /dev/shm, outgrowing the tree's memory cap, creating
namespaces. A root test fails, never skips, when the hardening it checks did not happen (the tree memory cap test
skips, saying why, only where no cgroup is writable at all). The unprivileged path is tested by running the sandbox
as uid ``nobody`` in a subprocess.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from gearlab.envs import sandbox
from gearlab.envs.sandbox import OUTPUT_CAP, run

IS_ROOT = os.geteuid() == 0
NEEDS_ROOT = pytest.mark.skipif(not IS_ROOT, reason="the hardened sandbox (private filesystem, namespaces, uid drop, "
                                                     "cgroup) needs root; not root here")
ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534

# unshare / setns / clone with CLONE_NEWUSER through libc; prints the errno of each attempt
NAMESPACE_ESCAPES = textwrap.dedent("""
    import ctypes, errno, os, threading
    libc = ctypes.CDLL(None, use_errno=True)
    def attempt(name, ret):
        print(name, "ok" if ret == 0 else errno.errorcode[ctypes.get_errno()])
    attempt("unshare_user", libc.unshare(0x10000000))
    attempt("unshare_mount", libc.unshare(0x00020000))
    attempt("unshare_net", libc.unshare(0x40000000))
    attempt("setns", libc.setns(os.open("/proc/self/ns/net", os.O_RDONLY), 0))
    SYS_clone = {"x86_64": 56, "aarch64": 220}[os.uname().machine]
    pid = libc.syscall(SYS_clone, 0x10000000 | 17, 0, 0, 0, 0)  # CLONE_NEWUSER | SIGCHLD
    if pid == 0:
        os._exit(0)
    attempt("clone_newuser", 0 if pid > 0 else -1)
    # ordinary process and thread creation still works (clone without namespace flags; clone3 -> ENOSYS -> clone)
    child = os.fork()
    if child == 0:
        os._exit(7)
    print("fork", os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
    t = threading.Thread(target=lambda: print("thread ran", flush=True))
    t.start()
    t.join()
    print("seccomp_mode", open("/proc/self/status").read().split("Seccomp:")[1].split()[0])
""")


def _procs_with_marker(marker: str) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(name))
        except OSError:
            continue
    return pids


def _procs_running_main_py_with(marker: str) -> list[int]:
    """Host pids whose cwd holds a main.py containing ``marker`` (forks keep the cwd, in or out of a sandbox)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cwd/main.py") as f:
                if marker in f.read():
                    found.append(int(name))
        except OSError:
            continue
    return found


def _key_values(stdout: str) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in stdout.splitlines() if " " in line)


def test_simple_print():
    r = run("print('hello', 1 + 2)", timeout_s=2)
    assert r.ok and r.error is None and r.returncode == 0 and not r.timed_out
    assert r.stdout == "hello 3\n"


def test_exception_reported():
    r = run("def f():\n    raise ValueError('bad value')\nf()\n", timeout_s=2)
    assert not r.ok and r.returncode == 1
    assert r.error == "ValueError: bad value"
    assert "Traceback" in r.stderr
    assert "_sandbox_reaper" not in r.stderr  # the traceback starts at the user's code


def test_exit_status_and_shutdown_like_python():
    assert run("import sys\nsys.exit(3)\n", timeout_s=2).returncode == 3
    r = run("import sys\nsys.exit('bye')\n", timeout_s=2)
    assert r.returncode == 1 and r.stderr == "bye\n"
    r = run("x = (\n", timeout_s=2)
    assert r.returncode == 1 and r.error.startswith("SyntaxError")
    code = ("import atexit, threading, time\n"
            "atexit.register(lambda: print('atexit ran'))\n"
            "threading.Thread(target=lambda: (time.sleep(0.2), print('thread done'))).start()\n"
            "print('main done', end=' ')\n")
    r = run(code, timeout_s=3)
    assert r.ok and r.stdout == "main done thread done\natexit ran\n"
    r = run("if __name__ == '__main__':\n    import sys\n    print(sys.argv[0].endswith('main.py'))\n", timeout_s=2)
    assert r.stdout == "True\n"


def test_infinite_loop_times_out():
    t0 = time.monotonic()
    r = run("while True:\n    pass\n", timeout_s=1.0)
    elapsed = time.monotonic() - t0
    assert r.timed_out and not r.ok
    assert r.error == "timed out after 1.0 s"
    assert elapsed < 2.5
    assert run("print('still alive')", timeout_s=2).ok  # the parent carries on


def test_fork_bomb_contained():
    marker = f"forkbomb_{uuid.uuid4().hex}"
    # the marker lives in main.py's source; children are forks, so look for them by their cwd
    code = f"# {marker}\nimport os\nwhile True:\n    os.fork()\n"
    t0 = time.monotonic()
    r = run(code, timeout_s=2.0)
    assert time.monotonic() - t0 < 4.0
    assert not r.ok and r.error
    time.sleep(0.1)
    assert _procs_running_main_py_with(marker) == []


def test_fork_bomb_with_marker_in_cmdline_leaves_nothing():
    marker = f"gearlabmarker{uuid.uuid4().hex}"
    code = ("import os, sys\n"
            f"os.execv(sys.executable, [sys.executable, '-c', 'import os\\nwhile True: os.fork()', '{marker}'])\n")
    r = run(code, timeout_s=1.5)
    assert not r.ok
    time.sleep(0.1)
    assert _procs_with_marker(marker) == []


def test_huge_allocation_memory_error():
    r = run("x = bytearray(10**10)\n", timeout_s=2, memory_mb=256)
    assert not r.ok and not r.timed_out
    assert r.error == "MemoryError"


def test_cannot_write_outside_dir(tmp_path):
    target = tmp_path / "victim.txt"
    target.write_text("original")
    new = tmp_path / "created.txt"
    code = (f"for p, mode in (({str(target)!r}, 'w'), ({str(new)!r}, 'w')):\n"
            "    try:\n        open(p, mode).write('pwned')\n        print('wrote', p)\n"
            "    except OSError as e:\n        print('denied', type(e).__name__)\n")
    r = run(code, timeout_s=2)
    if not r.privileges_dropped:
        pytest.skip("privileges not dropped (not root or no interpreter usable by an unprivileged uid): "
                    "the code may write wherever the caller can")
    assert r.ok, r.stderr
    assert target.read_text() == "original"
    assert not new.exists()
    assert "wrote" not in r.stdout


def test_environment_not_inherited(monkeypatch):
    monkeypatch.setenv("GEARLAB_TEST_SECRET", "s3cr3t")
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "tok")
    r = run("import os\nprint(dict(os.environ))\n", timeout_s=2)
    assert r.ok
    assert "s3cr3t" not in r.stdout and "GEARLAB_TEST_SECRET" not in r.stdout
    assert "MLFLOW" not in r.stdout


@NEEDS_ROOT
def test_cannot_read_root_only_file(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("topsecret")
    os.chmod(secret, 0o600)
    os.chmod(tmp_path, 0o755)  # even with a traversable directory
    r = run(f"print(open({str(secret)!r}).read())\n", timeout_s=2)
    assert r.privileges_dropped
    assert not r.ok
    assert "topsecret" not in r.stdout
    assert r.error.startswith(("PermissionError", "FileNotFoundError"))


@NEEDS_ROOT
def test_cannot_read_host_files():
    """World-readable host files - /etc/passwd, a file planted in a world-traversable temp dir (as a task's data
    and answers would be), the project's own files - are simply not there."""
    plant_dir = tempfile.mkdtemp(prefix="gearlab-plant-", dir="/tmp")
    try:
        os.chmod(plant_dir, 0o755)
        planted = Path(plant_dir) / "answers.json"
        secret = f"answer-{uuid.uuid4().hex}"
        planted.write_text(json.dumps({"answer": secret}))
        os.chmod(planted, 0o644)
        targets = ["/etc/passwd", str(planted), str(Path(__file__).resolve()), str(ROOT / "runs" / "mlflow.db"),
                   str(ROOT / "pyproject.toml")]
        code = ("import json, os\nout = {}\n"
                f"for p in {targets!r}:\n"
                "    try:\n        out[p] = open(p).read()\n    except OSError as e:\n        out[p] = "
                "type(e).__name__\n"
                "etc = sorted(os.listdir('/etc')) if os.path.isdir('/etc') else []\n"
                "print(json.dumps({'reads': out, 'root': sorted(os.listdir('/')), 'etc': etc}))\n")
        r = run(code, timeout_s=3)
        assert r.ok, r.stderr
        assert r.fs_isolated
        seen = json.loads(r.stdout)
        assert seen["reads"] == {p: "FileNotFoundError" for p in targets}
        assert secret not in r.stdout
        # "/" holds only the top directories of what the interpreter needs, plus the sandbox's own
        plan = sandbox._mode().plan
        assert set(seen["root"]) == {op[1].split("/")[1] for op in plan} | {"dev", "proc", "tmp", "var", "work"}
        assert set(seen["etc"]) <= {"ld.so.cache"}
        # the same reads from the host as an unprivileged uid would work: the files are really world-readable
        assert os.stat(planted).st_mode & 0o004 and os.stat("/etc/passwd").st_mode & 0o004
    finally:
        shutil.rmtree(plant_dir, ignore_errors=True)


@NEEDS_ROOT
def test_proc_shows_only_the_sandbox():
    code = ("import json, os\nprocs = {}\n"
            "for n in os.listdir('/proc'):\n"
            "    if n.isdigit():\n"
            "        try:\n            procs[n] = open(f'/proc/{n}/cmdline', 'rb').read().decode(errors='replace')\n"
            "        except OSError as e:\n            procs[n] = type(e).__name__\n"
            "print(json.dumps(procs))\n")
    r = run(code, timeout_s=3)
    assert r.ok, r.stderr
    assert r.pid_isolated
    procs = json.loads(r.stdout)
    assert list(procs) == ["1"]  # the code itself, pid 1 of its namespace
    host_pids = [n for n in os.listdir("/proc") if n.isdigit()]
    assert len(host_pids) > 5 and str(os.getpid()) in host_pids  # the host has many, the test runner among them
    assert "pytest" not in r.stdout


@NEEDS_ROOT
def test_tmp_var_tmp_and_dev_shm_are_private_size_capped_and_gone():
    marker = f"gearlab-leak-{uuid.uuid4().hex}"
    dirs = ["/tmp", "/var/tmp", "/dev/shm", "/work"]
    code = textwrap.dedent(f"""
        import os
        for d in {dirs!r}:
            with open(os.path.join(d, {marker!r}), "w") as f:
                f.write("x" * 1000)
            print("wrote", d)
        # try to fill RAM-backed /dev/shm with 300 MB (1 MiB per file: RLIMIT_FSIZE)
        total = 0
        chunk = b"x" * (1 << 20)
        try:
            for i in range(300):
                with open(f"/dev/shm/{marker}.{{i}}", "wb") as f:
                    f.write(chunk)
                total += len(chunk)
        except OSError as e:
            print("stopped", type(e).__name__)
        print("shm_bytes", total)
    """)
    r = run(code, timeout_s=5, memory_mb=512)
    assert r.ok, r.stderr
    assert r.fs_isolated
    for d in dirs:
        assert f"wrote {d}" in r.stdout  # the writes worked inside: private, writable directories
    lines = _key_values(r.stdout)
    assert lines["stopped"] == "OSError"  # ENOSPC
    assert 8 << 20 <= int(lines["shm_bytes"]) <= sandbox.SCRATCH_LIMIT_MB << 20
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not [n for n in os.listdir(d) if n.startswith(marker)], d


@NEEDS_ROOT
def test_one_memory_cap_for_the_whole_process_tree():
    """12 children of 200 MB each (every page touched) under memory_mb=512: RLIMIT_AS (512 MiB per process) lets
    each one allocate, the tree's cgroup lets at most 2 hold their 200 MB at once and OOM-kills the others."""
    backend = sandbox._cgroup_backend()
    if backend is None:
        pytest.skip("no writable cgroup (v2 with memory delegated, or v1 memory) here: the tree is bounded only by "
                    "RLIMIT_NPROC x RLIMIT_AS")
    marker = f"memtree_{uuid.uuid4().hex}"
    code = textwrap.dedent(f"""
        # {marker}
        import os, select, time
        r, w = os.pipe()
        kids = []
        for i in range(12):
            pid = os.fork()
            if pid == 0:
                os.close(r)
                block = bytearray(b"\\x01") * (200 * 2**20)
                os.write(w, b"g")
                time.sleep(60)
                os._exit(0)
            kids.append(pid)
        os.close(w)
        got, dead, deadline = 0, {{}}, time.time() + 12
        while time.time() < deadline and got + len(dead) < len(kids):
            if select.select([r], [], [], 0.05)[0]:
                got += len(os.read(r, 64))
            for pid in kids:
                if pid not in dead:
                    p, status = os.waitpid(pid, os.WNOHANG)
                    if p:
                        dead[pid] = status
        holding = sum(1 for pid in kids if pid not in dead)
        killed = sum(1 for s in dead.values() if os.WIFSIGNALED(s) and os.WTERMSIG(s) == 9)
        print(f"got {{got}}\\nholding {{holding}}\\nkilled {{killed}}", flush=True)
    """)
    r = run(code, timeout_s=20, memory_mb=512)
    assert r.memory_cap == backend.kind
    counts = _key_values(r.stdout)
    assert r.ok, (r.stdout, r.stderr)
    holding, got, killed = int(counts["holding"]), int(counts["got"]), int(counts["killed"])
    assert holding <= 2  # 2 x 200 MB fit in 512 MiB, 3 do not
    assert killed >= 12 - 2 - 1 and got <= 2 + killed  # each allocation beyond two cost another one's life
    assert r.oom_killed
    time.sleep(0.1)
    assert _procs_running_main_py_with(marker) == []


@NEEDS_ROOT
def test_no_new_namespaces():
    r = run(NAMESPACE_ESCAPES, timeout_s=3)
    assert r.ok, r.stderr
    assert r.seccomp_filtered
    got = _key_values(r.stdout)
    for name in ("unshare_user", "unshare_mount", "unshare_net", "setns", "clone_newuser"):
        assert got[name] == "EPERM", (name, r.stdout)
    assert got["fork"] == "7" and got["thread"] == "ran" and got["seccomp_mode"] == "2"


@NEEDS_ROOT
def test_sysv_shared_memory_does_not_outlive_the_call():
    key = 0x6E000000 + int(uuid.uuid4().hex[:6], 16)
    code = textwrap.dedent(f"""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        shmid = libc.shmget({key}, 1 << 20, 0o1000 | 0o666)  # IPC_CREAT
        print("shmid", shmid)
    """)
    r = run(code, timeout_s=3)
    assert r.ok, r.stderr
    assert int(_key_values(r.stdout)["shmid"]) >= 0  # created inside
    with open("/proc/sysvipc/shm") as f:
        keys = {int(line.split()[0]) for line in f.readlines()[1:] if line.split()}
    assert key not in keys


@NEEDS_ROOT
def test_concurrent_calls_do_not_share_the_process_limit():
    """RLIMIT_NPROC counts a uid's processes; every call runs as its own uid, so a fork bomb exhausts only its own."""
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    forker = ("import os, time\ntime.sleep(0.5)\npids = []\nfor _ in range(8):\n    pid = os.fork()\n"
              "    if pid == 0:\n        time.sleep(0.5)\n        os._exit(0)\n    pids.append(pid)\n"
              "for p in pids:\n    os.waitpid(p, 0)\nprint('forked 8')\n")
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(run, bomb, 2.5)] + [pool.submit(run, forker, 5.0) for _ in range(3)]
        results = [f.result() for f in futures]
    assert results[0].privileges_dropped and not results[0].ok
    for r in results[1:]:
        assert r.ok and r.stdout == "forked 8\n", (r.stdout, r.stderr)


@NEEDS_ROOT
def test_setup_failure_never_runs_the_code():
    marker = f"ran-{uuid.uuid4().hex}"
    broken = replace(sandbox._mode(), plan=(("bind", "/nonexistent/gearlab-sandbox-test"),))
    if not broken.fs:
        pytest.fail("running as root but the sandbox has no private filesystem: the hardened path is broken here")
    r = sandbox._run(broken, f"print({marker!r})\n", timeout_s=3, memory_mb=256)
    assert not r.ok and r.error.startswith("sandbox setup failed")
    assert marker not in r.stdout


def test_no_network_to_localhost():
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(5)
    srv.setblocking(False)
    port = srv.getsockname()[1]
    try:
        code = ("import socket\n"
                "s = socket.socket()\ns.settimeout(1)\n"
                f"try:\n    s.connect(('127.0.0.1', {port}))\n    print('CONNECTED')\n"
                "except OSError as e:\n    print('FAILED', e)\n")
        r = run(code, timeout_s=2)
        if not IS_ROOT and not r.network_isolated:
            pytest.skip("no network namespace without root/CAP_SYS_ADMIN: network not isolated")
        assert r.network_isolated
        assert r.ok, r.stderr
        assert "CONNECTED" not in r.stdout and "FAILED" in r.stdout
        with pytest.raises(BlockingIOError):
            srv.accept()
    finally:
        srv.close()


def test_cannot_kill_parent():
    r = run("import os, signal\nppid = os.getppid()\nprint('ppid', ppid)\n"
            "try:\n    os.kill(ppid, signal.SIGKILL)\nexcept OSError as e:\n    "
            "print(type(e).__name__)\nprint('done')\n",
            timeout_s=2)
    assert r.returncode is not None and not r.timed_out
    if r.pid_isolated:
        # the reaper lives outside the code's pid namespace: its parent pid reads 0 and the kill reaches nothing
        assert r.ok and r.stdout.startswith("ppid 0\n") and r.stdout.endswith("done\n")
    assert run("print(1)", timeout_s=2).ok


@NEEDS_ROOT  # without root, kill(-1) in the code would SIGKILL every process of the caller's uid, this test's too
def test_cannot_kill_all():
    sentinel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        r = run("import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError as e:\n    print(e)\n",
                timeout_s=2)
        assert r.pid_isolated and r.privileges_dropped
        time.sleep(0.05)
        assert sentinel.poll() is None  # a process of the caller survived kill(-1)
        assert run("print(1)", timeout_s=2).ok
    finally:
        sentinel.kill()
        sentinel.wait()


def test_large_output_truncated():
    t0 = time.monotonic()
    r = run("import sys\nsys.stdout.write('x' * (10 * 1024 * 1024))\n", timeout_s=3)
    assert time.monotonic() - t0 < 3.0
    assert r.ok and r.stdout_truncated
    assert r.stdout.startswith("x" * OUTPUT_CAP)
    assert len(r.stdout) < OUTPUT_CAP + 200
    assert "truncated" in r.stdout


# --- the unprivileged path ------------------------------------------------------------------------------------

UNPRIVILEGED_DRIVER = textwrap.dedent("""
    import importlib.util, json, os, sys
    spec = importlib.util.spec_from_file_location("gearlab_sandbox_copy", os.path.join(sys.argv[1], "sandbox.py"))
    sb = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = sb
    spec.loader.exec_module(sb)
    os.environ["GEARLAB_TEST_SECRET"] = "s3cr3t"
    out = {}
    for name, code, timeout_s in json.loads(sys.argv[2]):
        r = sb.run(code, timeout_s=timeout_s, memory_mb=256)
        out[name] = {k: getattr(r, k) for k in ("ok", "stdout", "stderr", "error", "timed_out", "fs_isolated",
                     "network_isolated", "pid_isolated", "privileges_dropped", "seccomp_filtered", "memory_cap")}
    out["uid"] = os.getuid()
    print(json.dumps(out))
""")


def _run_unprivileged(cases: list[tuple[str, str, float]]) -> dict:
    """Run ``cases`` through the sandbox as a process that is not root: as ``nobody`` (uid/gid 65534) when this
    test runs as root, else in the current (unprivileged) user; the sandbox's two files are copied to a directory
    that user can read."""
    work = Path(tempfile.mkdtemp(prefix="gearlab-unpriv-"))
    try:
        for name in ("sandbox.py", "_sandbox_reaper.py"):
            shutil.copy(Path(sandbox.__file__).with_name(name), work / name)
        (work / "driver.py").write_text(UNPRIVILEGED_DRIVER)
        os.chmod(work, 0o755)
        for p in work.iterdir():
            os.chmod(p, 0o644)
        if IS_ROOT:
            interpreter = sandbox._interpreter_for_unprivileged_uid()
            if interpreter is None:
                pytest.fail("running as root but no interpreter is executable by an unprivileged uid")

            def become_nobody() -> None:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            preexec = become_nobody
        else:
            interpreter, preexec = sys.executable, None
        p = subprocess.run([interpreter, "-I", "-S", str(work / "driver.py"), str(work), json.dumps(cases)],
                           capture_output=True, text=True, timeout=120, cwd=work, preexec_fn=preexec,
                           env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(work), "LANG": "C.UTF-8"})
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_unprivileged_path_keeps_its_guarantees_and_reports_what_it_lacks():
    cases = [
        ("print", "print('hi')", 3.0),
        ("loop", "while True:\n    pass\n", 1.0),
        ("alloc", "x = bytearray(10**10)\n", 3.0),
        ("env", "import os\nprint(sorted(os.environ))\n", 3.0),
        ("ns", NAMESPACE_ESCAPES, 5.0),
        ("passwd", "print(len(open('/etc/passwd').read()) > 0)\n", 3.0),
    ]
    out = _run_unprivileged(cases)
    assert out["uid"] != 0
    assert out["print"]["ok"] and out["print"]["stdout"] == "hi\n"
    assert out["loop"]["timed_out"]
    assert out["alloc"]["error"] == "MemoryError"
    assert out["env"]["ok"] and "GEARLAB_TEST_SECRET" not in out["env"]["stdout"]
    # what holds without root: the seccomp filter, so no namespace of any kind can be created
    ns = out["ns"]
    assert ns["ok"] and ns["seccomp_filtered"], ns["stderr"]
    got = _key_values(ns["stdout"])
    for name in ("unshare_user", "unshare_mount", "unshare_net", "setns", "clone_newuser"):
        assert got[name] == "EPERM", (name, ns["stdout"])
    assert got["fork"] == "7" and got["thread"] == "ran"
    # what does not, and the result says so: the host's files are readable, no namespaces, no uid drop, no cgroup
    for r in out.values():
        if isinstance(r, dict):
            assert not (r["fs_isolated"] or r["network_isolated"] or r["pid_isolated"] or r["privileges_dropped"])
            assert r["memory_cap"] == "rlimit"
    assert out["passwd"]["ok"] and out["passwd"]["stdout"] == "True\n"
