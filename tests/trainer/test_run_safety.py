"""Running `gearlab train` again, with another configuration, or stopping it by signal loses nothing: a finished run is
left byte-identical, a changed configuration is refused with one line (exit 2), a raised trainer.max_steps extends
the run exactly, and SIGTERM stops like Ctrl-C (checkpoint at the iteration boundary, MLflow run KILLED, the resume
line, exit 128 + the signal)."""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlflow
import pytest
import torch

from gearlab.config import ConfigError, load_config, to_yaml
from gearlab.rollout import fast
from gearlab.rollout.fast import resolve_attention
from gearlab.trainer.resume import check_resolved, check_resume
from gearlab.stopping import StopSignals
from gearlab.trainer.train import train


def _overrides(out: Path, model_dir: Path, *extra: str) -> list[str]:
    return [f"model.name_or_path={model_dir}", f"trainer.output_dir={out}", "trainer.max_steps=3",
            "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=8",
            "algorithm.micro_batch_size=8", "trainer.progress_bar=false", "optim.lr=1e-3", "eval.num_problems=4",
            "eval.k=2", "trainer.threads=1", *extra]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gearlab.cli", *args], capture_output=True, text=True, timeout=300)


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def _restore_sigint() -> None:
    """In the child before exec: SIGINT as in a terminal, also when the test runner ignores it (a CI lane may)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_finished_run_is_left_untouched_and_a_changed_config_is_refused(tmp_path, tiny_model_dir):
    ov = _overrides(tmp_path, tiny_model_dir)
    first = train(load_config(ov))
    rdir = first.run_dir
    before = _hashes(tmp_path)  # every file: run folder, checkpoint, final/, summary.json, .lock, mlflow.db

    out = _cli("train", *ov)
    assert out.returncode == 0, out.stderr[-2000:]
    (line,) = out.stdout.strip().splitlines()
    assert f"run {rdir} is finished (3 of 3 iterations; model in {rdir / 'final'})" in line
    assert "raise trainer.max_steps above 3" in line
    assert _hashes(tmp_path) == before
    summary = json.loads((rdir / "summary.json").read_text())
    assert summary["iterations_done"] == 3 and summary["metrics"] == pytest.approx(first.metrics)
    assert summary["metrics"]["eval/greedy_accuracy"] == first.metrics["eval/greedy_accuracy"]

    # optim.lr changed (refused); threads and the progress bar are free to differ (not named)
    out = _cli("train", *ov, "optim.lr=2e-3", "trainer.threads=2", "trainer.progress_bar=true")
    assert out.returncode == 2, out.stderr[-2000:]
    (err,) = out.stderr.strip().splitlines()
    assert err.startswith(f"gearlab: error: run folder {rdir} was started with another configuration: ")
    assert "optim.lr (saved 0.001, now 0.002)" in err and "trainer.run_name=NAME" in err
    assert "trainer.threads" not in err and "progress_bar" not in err
    assert _hashes(tmp_path) == before

    with pytest.raises(ConfigError, match=r"trainer.max_steps \(saved 3, now 2: it can only be raised\)"):
        train(load_config([*ov, "trainer.max_steps=2"]))
    assert _hashes(tmp_path) == before


def test_raising_max_steps_extends_the_run_exactly(tmp_path, tiny_model_dir):
    """3 iterations, then the same command with trainer.max_steps=5: two more iterations from the checkpoint, in the
    same MLflow run, ending with the weights of a run of 5 from the start; config.yaml then says 5."""
    ov = _overrides(tmp_path / "ext", tiny_model_dir)
    three = train(load_config(ov))
    cfg_before = (three.run_dir / "config.yaml").read_text()
    five = train(load_config([*ov, "trainer.max_steps=5"]))
    assert five.iterations_done == 5 and not five.already_finished and not five.stopped_early
    assert five.mlflow_run_id == three.mlflow_run_id
    cfg_after = (five.run_dir / "config.yaml").read_text()
    assert cfg_after == cfg_before.replace("max_steps: 3", "max_steps: 5") != cfg_before
    assert (five.run_dir / "checkpoints" / "config.yaml").read_text() == cfg_after
    ck = torch.load(five.run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert ck["gearlab"]["iterations_done"] == 5
    assert json.loads((five.run_dir / "summary.json").read_text())["iterations_done"] == 5

    client = mlflow.MlflowClient(five.tracking_uri)
    run = client.get_run(five.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.data.tags["max_steps_history"] == "3 -> 5"
    assert run.data.params["trainer.max_steps"] == "3"  # MLflow params are immutable: the tag says the rest
    assert sorted(m.step for m in client.get_metric_history(five.mlflow_run_id, "train/reward")) == [0, 1, 2, 3, 4]
    assert len(client.search_runs([run.info.experiment_id])) == 1

    direct = train(load_config(_overrides(tmp_path / "direct", tiny_model_dir, "trainer.max_steps=5")))
    a, b = _weights(five.run_dir / "final"), _weights(direct.run_dir / "final")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    assert train(load_config([*ov, "trainer.max_steps=5"])).already_finished


def test_resume_check_names_what_differs_and_lets_run_control_differ(tmp_path):
    """The rules of gearlab.trainer.resume on a saved config alone (no training)."""
    base = [f"trainer.output_dir={tmp_path}", "trainer.run_name=r", "assigner=gear", "rollout.engine=hf"]
    rdir = tmp_path / "r"
    rdir.mkdir()
    (rdir / "config.yaml").write_text(to_yaml(load_config(base)))
    free = ["trainer.threads=3", "trainer.deadline=5.0", "trainer.stop_after=1", "trainer.progress_bar=false",
            "trainer.log_every=5", "trainer.checkpoint_every=2", "algorithm.micro_batch_size=2", "compare.workers=4",
            "warmstart.steps=3", "trainer.max_steps=200"]
    state = check_resume(load_config([*base, *free]), rdir)
    assert state.exists and state.saved_max_steps == 80 and state.extends(load_config([*base, "trainer.max_steps=81"]))
    assert state.summary is None and not state.finished_for(load_config(base))
    assert check_resume(load_config([*base, "rollout.engine=auto"]), rdir).exists  # compared once resolved
    with pytest.raises(ConfigError) as e:
        check_resume(load_config([*base, "rollout.group_size=4", "assigner.options.q_on=0.5", "trainer.seed=1"]), rdir)
    msg = str(e.value)
    assert "rollout.group_size (saved 8, now 4)" in msg and "assigner.options.q_on (saved null, now 0.5)" in msg
    assert "trainer.seed (saved 0, now 1)" in msg and "\n" not in msg
    # an entry of an open dict that the saved run had and this command drops is a difference too
    (rdir / "config.yaml").write_text(to_yaml(load_config([*base, "logging.tags.team=a"])))
    with pytest.raises(ConfigError, match=r"logging.tags.team \(saved a, now unset\)"):
        check_resume(load_config(base), rdir)
    assert not check_resume(load_config([*base, "trainer.resume=never", "trainer.seed=7"]), rdir).exists


def _resolved_resume(base: list[str], rdir: Path) -> None:
    """What ``gearlab train`` checks on resume: the saved config, then the machine-dependent keys once resolved."""
    cfg = load_config(base)
    state = check_resume(cfg, rdir)
    cfg.rollout.fast.attention = resolve_attention(cfg)
    check_resolved(cfg, state, rdir)


def test_a_saved_sdpa_resumes_where_auto_is_sdpa_and_explicit_kernels_must_match(tmp_path, monkeypatch):
    """rollout.fast.attention=auto is compared once resolved: a run saved with sdpa (every CPU run, and every run
    before auto) resumes under auto on a CPU and is refused where auto is split; explicit values compare as saved."""
    base = [f"trainer.output_dir={tmp_path}", "trainer.run_name=r", "rollout.engine=hf"]
    rdir = tmp_path / "r"
    rdir.mkdir()
    (rdir / "config.yaml").write_text(to_yaml(load_config([*base, "rollout.fast.attention=sdpa"])))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _resolved_resume(base, rdir)  # auto, the default, is sdpa here
    _resolved_resume([*base, "rollout.fast.attention=sdpa"], rdir)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fast, "kernel_available", lambda device: True)
    with pytest.raises(ConfigError) as e:
        _resolved_resume(base, rdir)
    assert "rollout.fast.attention (saved sdpa, now split: what auto resolves to here)" in str(e.value)
    assert "resume it with rollout.fast.attention=sdpa," in str(e.value)
    _resolved_resume([*base, "rollout.fast.attention=sdpa"], rdir)  # what the refusal says to do
    (rdir / "config.yaml").write_text(to_yaml(load_config([*base, "rollout.fast.attention=flex"])))
    with pytest.raises(ConfigError, match=r"rollout.fast.attention \(saved flex, now split\)"):
        _resolved_resume([*base, "rollout.fast.attention=split"], rdir)


def test_the_engine_is_compared_once_resolved(tmp_path, monkeypatch, tiny_model_factory):
    """A run saved with rollout.engine=hf, resumed with auto where auto is fast, is refused in one line."""
    from gearlab.rollout.factory import resolve_engine

    base = [f"trainer.output_dir={tmp_path}", "trainer.run_name=r", "rollout.fast.attention=sdpa"]
    rdir = tmp_path / "r"
    rdir.mkdir()
    (rdir / "config.yaml").write_text(to_yaml(load_config([*base, "rollout.engine=hf"])))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = load_config(base)
    state = check_resume(cfg, rdir)
    cfg.rollout.engine = resolve_engine(cfg, tiny_model_factory(0))
    with pytest.raises(ConfigError) as e:
        check_resolved(cfg, state, rdir)
    (line,) = str(e.value).splitlines()
    assert "rollout.engine (saved hf, now fast: what auto resolves to here)" in line
    assert "resume it with rollout.engine=hf," in line and "rollout.fast.attention" not in line


def test_stop_scopes_nest_and_a_second_ctrl_c_aborts():
    """StopSignals with real signals: the first request is recorded (exit code 128 + signum) and told to the enclosing
    scope; a second SIGINT raises KeyboardInterrupt, a second SIGTERM does not; handlers are put back."""
    outer_calls: list[tuple[int, bool]] = []
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with StopSignals(lambda s, first: outer_calls.append((s, first)), abort_on_repeat=False) as outer:
            with StopSignals() as inner:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # Python runs the handler at the next bytecode boundary
                assert inner.signum == signal.SIGTERM and inner.exit_code == 143
                os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM: still a clean stop
                time.sleep(0.05)
                with pytest.raises(KeyboardInterrupt):
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(0.05)
            assert outer.exit_code == 143 and outer_calls[0] == (signal.SIGTERM, True)
            assert [c[1] for c in outer_calls] == [True, False, False]
            assert signal.getsignal(signal.SIGTERM) == outer.handle
            with StopSignals() as late:  # a scope begun after the request inherits it
                assert late.requested and late.exit_code == 143
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with StopSignals() as quiet:  # ignored (nohup, `cmd &`): stays ignored
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and not quiet.requested
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_training_at_an_iteration_boundary(tmp_path, tiny_model_dir, sig):
    """What `timeout`, Slurm or `docker stop` (SIGTERM) and Ctrl-C (SIGINT) do to `gearlab train`: the iteration
    finishes, its checkpoint is written, the MLflow run is KILLED with one value per iteration, the closing lines say
    how to resume (the same command), and the exit code is 128 + the signal."""
    args = ["train", *_overrides(tmp_path, tiny_model_dir, "trainer.max_steps=50", "trainer.checkpoint_every=1",
                                 "eval.num_problems=0")]
    proc = subprocess.Popen([sys.executable, "-m", "gearlab.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_restore_sigint)
    last = tmp_path / "arith-grpo-s0" / "checkpoints" / "last.ckpt"
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None and not last.is_file():
        time.sleep(0.1)
    assert proc.poll() is None, "training ended before the signal"
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 128 + sig, stderr[-3000:]
    assert f"stop requested ({sig.name})" in stderr
    n = torch.load(last, weights_only=False)["gearlab"]["iterations_done"]
    assert 1 <= n < 50
    assert f"interrupted after {n} of 50 iterations" in stdout
    assert f"resume (same MLflow run, exact): gearlab {shlex.join(args)}" in stdout
    run_id = (tmp_path / "arith-grpo-s0" / "mlflow_run_id").read_text()
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert client.get_run(run_id).info.status == "KILLED"
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/reward")) == list(range(n))
    assert not (tmp_path / "arith-grpo-s0" / "summary.json").exists()
    assert not (tmp_path / "arith-grpo-s0" / "final").exists()


def test_a_signal_during_the_warm_start_stops_it_at_the_next_step(tmp_path):
    """`gearlab train` on an embedded model whose warm start is not the shipped one trains it first; a SIGTERM then
    (a scheduler's time limit) ends it at the next SFT step with exit 143 and one line, not minutes later, and leaves
    no partial model folder for the next run to trip over."""
    args = ["train", "model.name_or_path=embedded:tiny-arith", f"trainer.output_dir={tmp_path}",
            "warmstart.steps=5000", "warmstart.n_eval=0", "trainer.progress_bar=false"]
    proc = subprocess.Popen([sys.executable, "-m", "gearlab.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_restore_sigint)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not any("`gearlab warmstart`" in ln for ln in lines):
        time.sleep(0.1)
    assert proc.poll() is None, "".join(lines)[-2000:]
    time.sleep(2)  # into the SFT steps
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    reader.join(timeout=10)
    assert proc.returncode == 143, "".join(lines)[-2000:]
    assert time.time() - t0 < 30
    msg = [ln for ln in lines if ln.startswith("gearlab: stopped (SIGTERM) during the warm start of")]
    assert len(msg) == 1 and "nothing was written" in msg[0] and "the same command starts it again" in msg[0]
    assert "stop requested (SIGTERM) before training began" in "".join(lines)
    assert not (tmp_path / "embedded" / "tiny-arith").exists()
    assert not list(tmp_path.glob("embedded/.*"))
