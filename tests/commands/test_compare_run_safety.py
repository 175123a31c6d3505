"""`gearlab compare` loses nothing: one comparison of a name at a time (a lock a dead process cannot leave behind), a
changed child configuration refused before any work, and Ctrl-C / SIGTERM stop the running children at an iteration
boundary, start no new one and count what stopped, finished and never started (exit 128 + the signal)."""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest

from gearlab.commands.compare import compare, comparison_lock
from gearlab.config import load_config


def _base(out: Path, model_dir: Path, *extra: str) -> list[str]:
    return [f"model.name_or_path={model_dir}", f"trainer.output_dir={out}", "trainer.max_steps=2",
            "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=8", "eval.num_problems=4",
            "eval.k=2", "trainer.progress_bar=false", "optim.lr=1e-3", "trainer.threads=1", *extra]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gearlab.cli", *args], capture_output=True, text=True, timeout=300)


def _hashes(root: Path) -> dict[str, str]:
    """Every file under ``root`` but the lock files (a command that takes a lock writes its pid there)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}


def _runs(out: Path, name: str) -> dict[str, object]:
    """label ("grpo-s0", or "parent") → MLflow run of comparison ``name``."""
    client = mlflow.MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name(f"compare/{name}")
    return {f"{r.data.tags['assigner']}-s{r.data.tags['seed']}" if "assigner" in r.data.tags else "parent": r
            for r in client.search_runs([exp.experiment_id])}


def _restore_sigint() -> None:
    """In the child before exec: SIGINT as in a terminal, also when the test runner ignores it (a CI lane may)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_and_signal(args: list[str], first_ckpt_of: Path, sig: int, *, group: bool = False) -> tuple[int, str, str]:
    """Run `gearlab ARGS`, send ``sig`` once ``first_ckpt_of`` holds a checkpoint (to the process group with ``group``,
    as a terminal's Ctrl-C does), and return (exit code, stdout, stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "gearlab.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=_restore_sigint)
    last = first_ckpt_of / "checkpoints" / "last.ckpt"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and not last.is_file():
        time.sleep(0.1)
    assert proc.poll() is None, f"the comparison ended before the signal: {proc.communicate()[1][-2000:]}"
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=240)
    return proc.returncode, out, err


def test_a_second_comparison_of_the_same_name_is_refused_and_a_dead_holder_blocks_nothing(tmp_path, tiny_model_dir):
    base = _base(tmp_path, tiny_model_dir, "trainer.max_steps=1")
    cfg = load_config([*base, "compare.name=lk", "compare.assigners=[grpo]", "compare.seeds=[0]"])
    with comparison_lock(cfg):  # held by this process, as a running `gearlab compare lk` would
        out = _cli("compare", *base, "name=lk", "assigners=[grpo]", "seeds=[0]")
    assert out.returncode == 2, out.stderr[-2000:]
    (line,) = out.stderr.strip().splitlines()
    assert line == (f"gearlab: error: comparison 'lk' ({tmp_path / 'lk'}) is in use by gearlab compare pid "
                    f"{os.getpid()}: wait for it to finish, or give this comparison another compare.name")
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "lk" / "grpo-s0").exists()
    # the lock file names a process that is gone (killed, crashed): the kernel released its lock with it
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "lk" / ".lock").write_text(f"gearlab compare pid {dead.stdout.strip()}")
    res = compare(cfg, base)
    assert res["failed"] == [] and not res.get("interrupted")
    assert _runs(tmp_path, "lk")["grpo-s0"].info.status == "FINISHED"


@pytest.mark.slow
def test_sigterm_stops_a_comparison_and_a_changed_config_is_refused(tmp_path, tiny_model_dir):
    """SIGTERM during the first of two children (workers=1, in this process; gear-s0: the baseline runs last): it
    stops at an iteration boundary, the second never starts, both runs are KILLED, exit 143. Re-running with another
    learning rate is then refused with one line naming the child and the key, and changes nothing."""
    base = _base(tmp_path, tiny_model_dir, "trainer.max_steps=50", "trainer.checkpoint_every=1")
    args = ["compare", *base, "name=st", "assigners=[grpo,gear]", "seeds=[0]"]
    code, out, err = _start_and_signal(args, tmp_path / "st" / "gear-s0", signal.SIGTERM)
    assert code == 143, err[-3000:]
    assert ("[compare] interrupted (stop requested by SIGTERM): 0 finished, 1 stopped at an iteration boundary, "
            "1 not started, 0 failed (of 2 to run)") in out
    assert not (tmp_path / "st" / "grpo-s0").exists()  # no child was launched after the signal
    runs = _runs(tmp_path, "st")
    assert set(runs) == {"parent", "gear-s0"}
    assert runs["gear-s0"].info.status == "KILLED" and runs["parent"].info.status == "KILLED"

    before = _hashes(tmp_path / "st")
    refused = _cli("compare", *base, "optim.lr=2e-3", "name=st", "assigners=[grpo,gear]", "seeds=[0]")
    assert refused.returncode == 2, refused.stderr[-2000:]
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("gearlab: error: comparison 'st', child gear-s0: run folder ")
    assert "optim.lr (saved 0.001, now 0.002)" in line
    assert _hashes(tmp_path / "st") == before
    assert _runs(tmp_path, "st")["parent"].info.status == "KILLED"  # not reopened


@pytest.mark.slow
def test_ctrl_c_stops_a_parallel_comparison_without_starting_queued_children(tmp_path, tiny_model_dir):
    """workers=2: a terminal's Ctrl-C (SIGINT to the whole process group) reaches the workers once, through the
    comparison: both running children stop at a boundary with a checkpoint, the two queued ones never start, exit \
130."""
    base = _base(tmp_path, tiny_model_dir, "trainer.max_steps=50", "trainer.checkpoint_every=1", "eval.num_problems=0")
    args = ["compare", *base, "name=pc", "assigners=[grpo,gear]", "seeds=[0,1]", "workers=2"]
    code, out, err = _start_and_signal(args, tmp_path / "pc" / "gear-s0", signal.SIGINT, group=True)
    assert code == 130, err[-3000:]
    # queued first (the baseline runs last in each seed): gear-s0; grpo-s0 ran beside it, unless its worker was still
    # starting when the signal came: then it never began
    started = [label for label in ("gear-s0", "grpo-s0") if (tmp_path / "pc" / label).exists()]
    assert started[0] == "gear-s0"
    assert (f"[compare] interrupted (stop requested by SIGINT): 0 finished, {len(started)} stopped at an iteration "
            f"boundary, {4 - len(started)} not started, 0 failed (of 4 to run)") in out
    runs = _runs(tmp_path, "pc")
    assert set(runs) == {"parent", *started}
    assert all(r.info.status == "KILLED" for r in runs.values())
    for label in started:
        assert (tmp_path / "pc" / label / "checkpoints" / "last.ckpt").is_file()
    assert not (tmp_path / "pc" / "grpo-s1").exists() and not (tmp_path / "pc" / "gear-s1").exists()
