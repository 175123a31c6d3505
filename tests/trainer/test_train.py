"""End-to-end `gearlab train` on the tiny model: MLflow record, exact resume, bad-input handling."""
from __future__ import annotations

import subprocess
import sys

import mlflow
import pytest
import torch
from omegaconf import OmegaConf

from gearlab.config import load_config
from gearlab.trainer.train import train


def _overrides(tmp_path, model_dir, *extra):
    return [f"model.name_or_path={model_dir}", f"trainer.output_dir={tmp_path}", "trainer.max_steps=3",
            "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=12",
            "algorithm.micro_batch_size=8", "trainer.progress_bar=false", "optim.lr=1e-3", "eval.num_problems=8",
            "rollout.batch_size=64", *extra]


def _params(run_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(run_dir / "final").state_dict()


def test_train_logs_to_mlflow(tmp_path, tiny_model_dir):
    res = train(load_config(_overrides(tmp_path, tiny_model_dir, "algorithm.mini_batches=2", "algorithm.kl_coef=0.01")))
    client = mlflow.MlflowClient(res.tracking_uri)
    run = client.get_run(res.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert {"assigner", "seed", "task", "model", "git_sha"} <= set(run.data.tags)
    assert run.data.tags["assigner"] == "grpo" and run.data.params["rollout.group_size"] == "4"
    # rollout.engine=auto (the default) is recorded as the engine it resolved to: HF generate without a GPU
    assert run.data.params["rollout.engine"] == "hf" and "engine: hf" in (res.run_dir / "config.yaml").read_text()
    # rollout.fast.attention=auto (the default) too: SDPA without CUDA
    saved = OmegaConf.load(res.run_dir / "config.yaml")
    assert saved.rollout.fast.attention == "sdpa" and run.data.params["rollout.fast.attention"] == "sdpa"
    hist = client.get_metric_history(res.mlflow_run_id, "train/reward")
    assert sorted(m.step for m in hist) == [0, 1, 2]  # MLflow step = RL iteration
    keys = set(run.data.metrics)
    assert "train/pass_at_4" in keys and "update/clipfrac" in keys and "update/kl" in keys
    assert not any(c in k for k in keys for c in "@()")
    assert (res.run_dir / "checkpoints" / "last.ckpt").is_file() and (
        res.run_dir / "checkpoints" / "config.yaml"
    ).is_file()


def test_resume_is_exact(tmp_path, tiny_model_dir):
    """A run that crashes after iteration 2 and is resumed ends with the same parameters as an uninterrupted run."""
    common = ["trainer.max_steps=4", "trainer.checkpoint_every=1", "algorithm.mini_batches=2",
              "optim.schedule=cosine", "optim.warmup_steps=2"]
    full = train(load_config(_overrides(tmp_path / "a", tiny_model_dir, *common)))

    from gearlab.trainer import module as module_mod

    original = module_mod.GRPOModule.training_step

    def crash_at_2(self, batch, batch_idx):
        if batch["iteration"] == 2:
            raise KeyboardInterrupt  # like Ctrl-C in the middle of iteration 3
        return original(self, batch, batch_idx)

    cfg = load_config(_overrides(tmp_path / "b", tiny_model_dir, *common))
    module_mod.GRPOModule.training_step = crash_at_2
    try:
        try:
            train(cfg)
        except (KeyboardInterrupt, SystemExit):
            pass
    finally:
        module_mod.GRPOModule.training_step = original
    ck = torch.load(tmp_path / "b" / f"{full.run_dir.name}" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ck["gearlab"]["iterations_done"] == 2
    resumed = train(cfg)
    assert resumed.mlflow_run_id == (tmp_path / "b" / full.run_dir.name / "mlflow_run_id").read_text()
    a, b = _params(full.run_dir), _params(resumed.run_dir)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    client = mlflow.MlflowClient(resumed.tracking_uri)
    assert len(client.get_metric_history(resumed.mlflow_run_id, "train/reward")) == 4


@pytest.mark.parametrize("bad,needle", [
    (["trainer.max_stepz=3"], "trainer.max_stepz"),
    (["trainer.max_steps=three"], "trainer.max_steps"),
    (["model.name_or_path=./no/such/model"], "model folder not found"),
    (["assigner=no_such_method"], "unknown credit assigner 'no_such_method'; known: "),
    (["task=no_such_task"], "no task named"),
    (["assigner.options.bogus=1"], "assigner 'grpo'"),
    (["warmstart.device=tpu"], "key 'warmstart.device': 'tpu' is not one of cpu, cuda, auto"),
])
def test_bad_config_is_one_line_exit_2(tmp_path, bad, needle):
    out = subprocess.run([sys.executable, "-m", "gearlab.cli", "train", f"trainer.output_dir={tmp_path}", *bad],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], out.stderr
    assert not any(tmp_path.iterdir())  # no work started: nothing written


def test_train_against_a_real_mlflow_server(tmp_path, tiny_model_dir, mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    res = train(load_config(_overrides(tmp_path, tiny_model_dir, "trainer.max_steps=2", "logging.experiment=srv")))
    assert res.tracking_uri == mlflow_server
    client = mlflow.MlflowClient(mlflow_server)
    run = client.get_run(res.mlflow_run_id)
    assert run.info.status == "FINISHED" and len(client.get_metric_history(run.info.run_id, "train/accuracy")) == 2
    assert "config.yaml" in [a.path for a in client.list_artifacts(run.info.run_id)]
    assert not (tmp_path / "mlflow.db").exists()  # nothing went to the local default


def test_nonfinite_loss_skips_the_step_then_stops_with_a_checkpoint(tmp_path, tiny_model_dir, monkeypatch):
    from gearlab.core import grpo
    from gearlab.trainer.update import NonFiniteLossError

    real = grpo.policy_loss
    calls = {"n": 0}

    def flaky(*a, **k):  # the 1st optimizer step is poisoned, then the 3rd and everything after
        calls["n"] += 1
        loss, m = real(*a, **k)
        return (loss * float("nan") if calls["n"] == 1 or calls["n"] >= 3 else loss), m

    monkeypatch.setattr(grpo, "policy_loss", flaky)
    cfg = load_config(_overrides(tmp_path, tiny_model_dir, "trainer.max_steps=6", "trainer.max_nonfinite=2",
                                 "algorithm.micro_batch_size=16"))
    with pytest.raises(NonFiniteLossError, match="2 consecutive"):
        train(cfg)
    rdir = tmp_path / "arith-grpo-s0"
    assert (rdir / "checkpoints" / "nonfinite.ckpt").is_file()
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run((rdir / "mlflow_run_id").read_text())
    assert run.info.status == "FAILED"
    hist = client.get_metric_history(run.info.run_id, "train/nonfinite_steps_total")
    assert [m.value for m in sorted(hist, key=lambda m: m.step)] == [1.0, 1.0, 2.0]


@pytest.fixture(scope="module")
def flaky_task():
    from gearlab.tasks.arithmetic import ArithmeticTask
    from gearlab.tasks.registry import register_task

    @register_task("flaky_arith_for_tests")
    class FlakyArith(ArithmeticTask):
        def reward(self, problem, completion):
            if len(completion) % 2:
                raise RuntimeError("verifier crashed")
            return super().reward(problem, completion)

    return "flaky_arith_for_tests"


def test_reward_errors_score_zero_and_are_counted(tmp_path, tiny_model_dir, flaky_task):
    res = train(load_config(_overrides(tmp_path, tiny_model_dir, f"task.name={flaky_task}", "trainer.max_steps=2")))
    client = mlflow.MlflowClient(res.tracking_uri)
    errors = client.get_run(res.mlflow_run_id).data.metrics["train/reward_errors_total"]
    assert errors > 0


def test_reward_errors_can_stop_the_run(tmp_path, tiny_model_dir, flaky_task):
    cfg = load_config(_overrides(tmp_path, tiny_model_dir, f"task.name={flaky_task}", "trainer.reward_errors=raise"))
    with pytest.raises(RuntimeError, match="verifier crashed"):
        train(cfg)


def test_dataset_row_without_answer_names_file_and_row(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?"}\n')
    out = subprocess.run([sys.executable, "-m", "gearlab.cli", "train", "task.name=jsonl",
                          f"task.options.train_path={data}", f"trainer.output_dir={tmp_path / 'out'}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"{data}:2: row has no 'answer'" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_no_learning_signal_is_warned_and_training_problems_are_not_called_held_out(tmp_path, tiny_model_dir, caplog):
    """A jsonl file whose answers the random model never produces: every group's rewards are equal (all 0), so each
    iteration warns, the third in a row louder; with no test file the evaluation is on the training problems and
    nothing calls it held-out; eval/avg_at_2 is read back by that, the documented, name."""
    import logging

    from gearlab.commands.closing import train_summary
    from gearlab.commands.compare import primary_metric

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(f'{{"prompt": "What is {i}+{i}?", "answer": "never-{i}"}}\n' for i in range(6)))
    cfg = load_config(_overrides(tmp_path, tiny_model_dir, "task=jsonl", f"task.options.train_path={data}",
                                 "trainer.max_steps=4", "rollout.prompts_per_step=2", "rollout.group_size=2",
                                 "rollout.max_new_tokens=8", "eval.num_problems=2", "eval.k=2"))
    caplog.set_level(logging.WARNING, logger="gearlab")
    res = train(cfg)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "gearlab"]
    assert [m for lvl, m in said if "no learning signal" in m] == [
        f"iteration {i}/4: no learning signal: every group's 2 samples got equal rewards (mean reward 0.000), so every "
        f"GRPO advantage is 0" for i in range(1, 5)]
    assert [m for lvl, m in said if lvl == logging.ERROR] == [
        "NO LEARNING SIGNAL for 3 iterations in a row (3 of 3 so far): the run is training on nothing — no sample "
        "earned any reward: check that the answers are extracted and scored as intended (the task's answer format, "
        "its reward) and that the problems are within the model's reach (trainer.no_signal_patience=3)"]
    assert (logging.WARNING, "the evaluation uses the TRAINING problems: task 'jsonl' has no separate test split "
            "(jsonl: set task.options.test_path); eval/* measures fitting, not generalisation") in said
    client = mlflow.MlflowClient(res.tracking_uri)
    run = client.get_run(res.mlflow_run_id)
    assert run.data.tags["eval_split"] == "train" and not res.eval_held_out
    counted = sorted(
        client.get_metric_history(res.mlflow_run_id, "train/no_signal_iterations_total"), key=lambda m: m.step
    )
    assert [m.value for m in counted] == [1.0, 2.0, 3.0, 4.0]
    # the name compare and the docs use is the name on record: before training and after the last iteration
    assert primary_metric(load_config(["eval.k=2"])) == "eval/avg_at_2"
    assert sorted(m.step for m in client.get_metric_history(res.mlflow_run_id, "eval/avg_at_2")) == [0, 4]
    timed = client.get_metric_history(res.mlflow_run_id, "time/eval_s")  # each evaluation's own time
    assert sorted(m.step for m in timed) == [0, 4] and all(m.value > 0 for m in timed)
    assert not any("@" in k for k in run.data.metrics)
    lines = train_summary(res, ["train"], cfg).splitlines()
    assert ("final evaluation on the TRAINING problems (the task has no separate test split; not held-out): "
            "avg_at_2 0.0%, greedy_accuracy 0.0%, pass_at_2 0.0%") in lines
    assert not any("held-out evaluation" in line for line in lines)
    assert "iterations without learning signal (every group's rewards equal): 4 of 4" in lines
    exp_id = run.info.experiment_id
    assert (f"look at it: mlflow ui --backend-store-uri {res.tracking_uri}, then open "
            f"http://127.0.0.1:5000/#/experiments/{exp_id}/runs?workflowType=machine_learning") in lines
    assert (f"see its credit on one batch: gearlab inspect task=jsonl model.name_or_path={res.run_dir / 'final'} "
            f"task.options.train_path={data} rollout.group_size=2 rollout.max_new_tokens=8 "
            f"algorithm.micro_batch_size=8") in lines


def test_eval_and_help_commands(tmp_path, tiny_model_dir):
    from gearlab.cli import main

    assert main(["--help"]) == 0
    out = subprocess.run([sys.executable, "-m", "gearlab.cli", "eval", f"model.name_or_path={tiny_model_dir}",
                          "eval.num_problems=8", "eval.k=2", "rollout.max_new_tokens=8",
                          f"trainer.output_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import json

    res = json.loads(out.stdout)
    assert res["problems"] == 8 and 0 <= res["greedy_accuracy"] <= 1 and res["pass@2"] >= res["avg@2"]


def test_killed_process_resumes_the_same_mlflow_run(tmp_path, tiny_model_dir):
    """SIGKILL mid-run (no chance to clean up), then the same command again: it resumes from the last
    checkpoint into the same MLflow run and finishes every iteration."""
    import os
    import signal
    import time

    args = [sys.executable, "-m", "gearlab.cli", "train",
            *_overrides(tmp_path, tiny_model_dir, "trainer.max_steps=8", "trainer.checkpoint_every=1")]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    last = tmp_path / "arith-grpo-s0" / "checkpoints" / "last.ckpt"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if last.is_file() and torch.load(last, weights_only=False)["gearlab"]["iterations_done"] >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "training ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    run_id = (tmp_path / "arith-grpo-s0" / "mlflow_run_id").read_text()
    out = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert torch.load(last, weights_only=False)["gearlab"]["iterations_done"] == 8
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags.get("resumed") == "true"
    assert {m.step for m in client.get_metric_history(run_id, "train/reward")} == set(range(8))
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_second_run_on_the_same_folder_refuses(tmp_path, tiny_model_dir):
    """Two identical `gearlab train` at once: the second stops with one line (exit 2) before any work, instead
    of writing the same checkpoints and opening a second MLflow run."""
    from gearlab.trainer.train import run_dir, run_folder_lock

    cfg = load_config(_overrides(tmp_path, tiny_model_dir))
    with run_folder_lock(run_dir(cfg)):
        out = subprocess.run([sys.executable, "-m", "gearlab.cli", "train", *_overrides(tmp_path, tiny_model_dir)],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "is in use by gearlab pid" in lines[0] and "trainer.run_name" in lines[0], out.stderr
    assert not (run_dir(cfg) / "mlflow_run_id").exists() and not (tmp_path / "mlflow.db").exists()
    # released: the same command now runs
    assert train(cfg).iterations_done == 3


def test_ctrl_c_stops_at_an_iteration_boundary_and_resumes_once(tmp_path, tiny_model_dir, monkeypatch):
    """Ctrl-C (a real SIGINT through the handler) finishes the iteration, checkpoints it, marks the MLflow run
    KILLED and says how to resume; the same command then finishes with one value per iteration in MLflow."""
    import os
    import signal

    from gearlab.trainer import module as module_mod
    from gearlab.commands.closing import train_summary

    real = module_mod.GRPOModule._update

    def ctrl_c_during_iteration_3(self, rb, adv, loss_mask, it, **kw):
        if it == 2 and not self.interrupted:  # the update of iteration 3
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, rb, adv, loss_mask, it, **kw)

    cfg = load_config(_overrides(tmp_path, tiny_model_dir, "trainer.max_steps=6", "trainer.checkpoint_every=10"))
    monkeypatch.setattr(module_mod.GRPOModule, "_update", ctrl_c_during_iteration_3)
    # as in a terminal (CI may run with SIGINT ignored)
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        first = train(cfg)
        restored = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, outer)
    monkeypatch.setattr(module_mod.GRPOModule, "_update", real)
    assert first.stopped_early and first.interrupted and first.iterations_done == 3
    assert restored is signal.default_int_handler  # the handler before the run is back
    client = mlflow.MlflowClient(first.tracking_uri)
    assert client.get_run(first.mlflow_run_id).info.status == "KILLED"
    ck = torch.load(first.run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert ck["gearlab"]["iterations_done"] == 3
    text = train_summary(first, ["train", "trainer.max_steps=6"])
    assert "interrupted after 3 of 6 iterations" in text and (
        "resume (same MLflow run, exact): gearlab train trainer.max_steps=6"
    ) in text
    second = train(cfg)
    assert second.mlflow_run_id == first.mlflow_run_id and second.iterations_done == 6 and not second.stopped_early
    assert client.get_run(first.mlflow_run_id).info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(first.mlflow_run_id, "train/reward")]
    assert sorted(steps) == list(range(6))  # one value per iteration, none twice
    text = train_summary(second, ["train"])
    assert "done: 6 iterations" in text and "greedy_accuracy" in text and (
        "mlflow ui --backend-store-uri sqlite:///"
    ) in text
    # the run's task and the sampling keys it changed, read back from the run folder's config.yaml
    assert (f"see its credit on one batch: gearlab inspect task=arith model.name_or_path={second.run_dir / 'final'} "
            f"rollout.group_size=4 rollout.max_new_tokens=12 algorithm.micro_batch_size=8") in text.splitlines()


def test_deadline_stops_after_the_iteration_with_a_checkpoint_and_resumes(tmp_path, tiny_model_dir):
    """trainer.deadline (a Unix time) passed: the run ends at the next iteration boundary, resumable, as for Ctrl-C."""
    first = train(
        load_config(_overrides(tmp_path, tiny_model_dir, "trainer.deadline=1", "trainer.checkpoint_every=10"))
    )
    assert first.stopped_early and not first.interrupted and first.iterations_done == 1
    ck = torch.load(first.run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert ck["gearlab"]["iterations_done"] == 1
    client = mlflow.MlflowClient(first.tracking_uri)
    assert client.get_run(first.mlflow_run_id).info.status == "KILLED"
    second = train(load_config(_overrides(tmp_path, tiny_model_dir)))
    assert second.mlflow_run_id == first.mlflow_run_id and second.iterations_done == 3 and not second.stopped_early
    assert sorted(m.step for m in client.get_metric_history(first.mlflow_run_id, "train/reward")) == [0, 1, 2]
    # every method's credit statistics are on record each iteration; GRPO's equal its own broadcast
    run = client.get_run(first.mlflow_run_id)
    assert run.data.params["credit.normalisation"] == "group mean, divided by group std (unbiased)"
    for k in ("adv_mean", "adv_std", "adv_abs_mean", "abs_up_frac", "abs_down_frac", "sign_flip_frac", "zero_frac"):
        assert len(client.get_metric_history(first.mlflow_run_id, f"credit/{k}")) == 3, k
    assert run.data.metrics["credit/sign_flip_frac"] == run.data.metrics["credit/abs_up_frac"] == 0.0


def test_resumed_run_logs_each_iteration_once_after_a_hard_kill(tmp_path, tiny_model_dir):
    """A process killed between logging an iteration and checkpointing it re-runs that iteration on resume; the
    resume is exact, so the value on record is kept and not logged a second time."""
    from gearlab.trainer import module as module_mod

    cfg = load_config(_overrides(tmp_path, tiny_model_dir, "trainer.max_steps=5", "trainer.checkpoint_every=2"))
    original = module_mod.GRPOModule.training_step

    def die_in_iteration_4(self, batch, batch_idx):
        if batch["iteration"] == 3:  # iterations 1-3 logged, checkpoint at 2
            raise RuntimeError("simulated crash")
        return original(self, batch, batch_idx)

    module_mod.GRPOModule.training_step = die_in_iteration_4
    try:
        with pytest.raises(RuntimeError):
            train(cfg)
    finally:
        module_mod.GRPOModule.training_step = original
    res = train(cfg)
    client = mlflow.MlflowClient(res.tracking_uri)
    for key in ("train/reward", "train/iteration", "update/clipfrac"):
        steps = [m.step for m in client.get_metric_history(res.mlflow_run_id, key)]
        assert sorted(steps) == list(range(5)), (key, steps)


@pytest.mark.parametrize("command", ["train", "eval", "inspect", "replay", "compare", "export"])
def test_missing_model_is_one_line_in_every_command(tmp_path, command, capsys):
    from gearlab.cli import main

    missing = tmp_path / "runs" / "arith-grpo-s0" / "final"
    extra = {"replay": [f"replay.rollouts={tmp_path / 'r.pt'}"],
             "export": [f"export.checkpoint={tmp_path / 'last.ckpt'}",
             f"export.out={tmp_path / 'hf'}"]}.get(command, [])
    assert main([command, f"model.name_or_path={missing}", f"trainer.output_dir={tmp_path / 'out'}",
                 f"inspect.out_dir={tmp_path / 'insp'}", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.name_or_path" in err[0] and "model folder not found" in err[0], err


def test_run_folder_instead_of_its_model_gets_a_hint(tmp_path, tiny_model_dir, capsys):
    import shutil

    from gearlab.cli import main

    run = tmp_path / "grpo-s0"
    shutil.copytree(tiny_model_dir, run / "final")
    assert main(["eval", f"model.name_or_path={run}", f"trainer.output_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no config.json" in err[0] and f"did you mean {run / 'final'}" in err[0], err


def test_jsonl_task_from_the_readme(tmp_path, tiny_model_dir, capsys):
    """`gearlab train ... task=jsonl task.options.train_path=...` (docs/configuration.md's example) runs; without the
    path it is one line naming the option."""
    import json

    from gearlab.cli import main

    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n" for i in range(20))
    )
    assert main(["train", "task=jsonl", f"task.options.train_path={data}",
                 *_overrides(tmp_path, tiny_model_dir, "trainer.max_steps=1")]) == 0
    assert "done: 1 iterations" in capsys.readouterr().out
    assert main(["train", "task=jsonl", f"trainer.output_dir={tmp_path / 'o2'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "task.options.train_path" in err[0], err
