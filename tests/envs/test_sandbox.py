"""Tests for gearlab.envs.sandbox: each case runs real child processes with small timeouts."""
from __future__ import annotations

import os
import socket
import time
import uuid

import pytest

from gearlab.envs.sandbox import OUTPUT_CAP, run

IS_ROOT = os.geteuid() == 0


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


def test_simple_print():
    r = run("print('hello', 1 + 2)", timeout_s=2)
    assert r.ok and r.error is None and r.returncode == 0 and not r.timed_out
    assert r.stdout == "hello 3\n"


def test_exception_reported():
    r = run("def f():\n    raise ValueError('bad value')\nf()\n", timeout_s=2)
    assert not r.ok and r.returncode == 1
    assert r.error == "ValueError: bad value"
    assert "Traceback" in r.stderr


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
    # the marker lives in main.py's source; children are forks, so look for them by session / pid ns
    code = f"# {marker}\nimport os\nwhile True:\n    os.fork()\n"
    t0 = time.monotonic()
    r = run(code, timeout_s=2.0)
    assert time.monotonic() - t0 < 4.0
    assert not r.ok and r.error
    time.sleep(0.1)
    leftover = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cwd/main.py") as f:
                if marker in f.read():
                    leftover.append(int(name))
        except OSError:
            continue
    assert leftover == []


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
        pytest.skip("privileges not dropped (not root or no interpreter usable by nobody): "
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


@pytest.mark.skipif(not IS_ROOT, reason="only meaningful as root, where privileges are dropped to nobody")
def test_cannot_read_root_only_file(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("topsecret")
    os.chmod(secret, 0o600)
    os.chmod(tmp_path, 0o755)  # even with a traversable directory
    r = run(f"print(open({str(secret)!r}).read())\n", timeout_s=2)
    if not r.privileges_dropped:
        pytest.skip("running as root but no interpreter is usable by nobody: privileges were not dropped")
    assert not r.ok
    assert "topsecret" not in r.stdout
    assert "PermissionError" in (r.error or "")


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
        if not r.network_isolated:
            pytest.skip("no network namespace available (needs root/CAP_SYS_ADMIN): network not isolated")
        assert r.ok, r.stderr
        assert "CONNECTED" not in r.stdout and "FAILED" in r.stdout
        with pytest.raises(BlockingIOError):
            srv.accept()
    finally:
        srv.close()


def test_cannot_kill_parent():
    r = run("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('done')\n", timeout_s=2)
    # we are still here; the child's parent is the sandbox reaper (or pid 0 in its pid namespace)
    assert os.getpid() > 0
    assert r.returncode is not None
    assert run("print(1)", timeout_s=2).ok


def test_cannot_kill_all():
    r = run("import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError as e:\n    print(e)\n",
            timeout_s=2)
    if not (r.pid_isolated or r.privileges_dropped):
        pytest.skip("neither pid namespace nor privilege drop: kill(-1) would hit the caller's processes")
    assert run("print(1)", timeout_s=2).ok


def test_large_output_truncated():
    t0 = time.monotonic()
    r = run("import sys\nsys.stdout.write('x' * (10 * 1024 * 1024))\n", timeout_s=3)
    assert time.monotonic() - t0 < 3.0
    assert r.ok and r.stdout_truncated
    assert r.stdout.startswith("x" * OUTPUT_CAP)
    assert len(r.stdout) < OUTPUT_CAP + 200
    assert "truncated" in r.stdout
