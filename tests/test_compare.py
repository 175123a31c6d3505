"""Paired comparisons: same data and sampling per seed, determinism, resumable, crash-tolerant,
and a report rebuilt from MLflow alone (local SQLite and a real remote server)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import mlflow
import pytest
import torch

from gearlab.compare import compare
from gearlab.config import load_config
from gearlab.report import t_interval
from gearlab.train import train


def _base(tmp_path, model_dir, *extra):
    return [f"model.name_or_path={model_dir}", f"trainer.output_dir={tmp_path}", "trainer.max_steps=3",
            "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=10", "eval.num_problems=6",
            "eval.k=2", "trainer.progress_bar=false", "optim.lr=1e-3", *extra]


def _run(tmp_path, model_dir, name, assigners, seeds, *extra):
    base = _base(tmp_path, model_dir, *extra)
    cfg = load_config([*base, f"compare.name={name}", f"compare.assigners={assigners}", f"compare.seeds={seeds}"])
    return compare(cfg, base), cfg


def _histories(client, run_id, prefix=("train/", "eval/", "update/", "credit/")):
    keys = [k for k in client.get_run(run_id).data.metrics if k.startswith(prefix)]
    return {k: [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, k), key=lambda m: m.step)] for k in keys}


def test_paired_design_report_and_resume(tmp_path, tiny_model_dir, capsys):
    out, cfg = _run(tmp_path, tiny_model_dir, "pair", "[grpo,entropy_adv]", "[0,1]")
    assert out["failed"] == []
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("compare/pair")
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if r.data.tags.get("gearlab.role") == "parent")
    kids = {(r.data.tags["assigner"], r.data.tags["seed"]): r for r in runs if "assigner" in r.data.tags}
    assert len(kids) == 4 and all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in kids.values())
    assert all(r.data.tags["comparison_id"] == "pair" for r in kids.values())
    h = {k: _histories(client, r.info.run_id) for k, r in kids.items()}
    for seed in ("0", "1"):
        g, e = h[("grpo", seed)], h[("entropy_adv", seed)]
        assert g["train/data_crc"] == e["train/data_crc"]  # same prompts in the same order
        assert g["train/reward"][0] == e["train/reward"][0]  # same initial weights + same sampling seed
        assert g["eval/greedy_accuracy"][0] == e["eval/greedy_accuracy"][0]  # same eval problems before training
    assert h[("grpo", "0")]["train/data_crc"] != h[("grpo", "1")]["train/data_crc"]  # seeds differ
    assert "report/report.md" in [a.path for a in client.list_artifacts(parent.info.run_id, "report")]
    table = capsys.readouterr().out.split("| method")[1].split("[compare]")[0]
    # the same table from MLflow alone, in a new process
    rep = subprocess.run([sys.executable, "-m", "gearlab.cli", "report", "pair", f"trainer.output_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    assert table.strip() in rep.stdout
    # re-running skips every finished child
    out2, _ = _run(tmp_path, tiny_model_dir, "pair", "[grpo,entropy_adv]", "[0,1]")
    assert "4 already finished, 0 to run" in capsys.readouterr().out


def test_same_seed_same_metrics(tmp_path, tiny_model_dir):
    a = train(load_config(_base(tmp_path / "a", tiny_model_dir, "assigner=gear")))
    b = train(load_config(_base(tmp_path / "b", tiny_model_dir, "assigner=gear")))
    ha = _histories(mlflow.MlflowClient(a.tracking_uri), a.mlflow_run_id)
    hb = _histories(mlflow.MlflowClient(b.tracking_uri), b.mlflow_run_id)
    assert ha == hb and len(ha["train/reward"]) == 3


CRASHY = '''
from gearlab.credit import CreditAssigner, CreditOutput, register

@register("crashy")
class Crashy(CreditAssigner):
    def setup(self, *, seed, total_steps, task):
        self.seed = seed

    def assign(self, batch, seq_advantages, signals):
        if self.seed == 1:
            raise RuntimeError("credit exploded on seed 1")
        return CreditOutput(seq_advantages[:, None] * batch.response_mask)
'''


def test_a_crashed_child_is_recorded_and_the_comparison_goes_on(tmp_path, tiny_model_dir):
    plug = tmp_path / "crashy.py"
    plug.write_text(CRASHY)
    out, cfg = _run(tmp_path, tiny_model_dir, "crash", "[grpo,crashy]", "[0,1]", f"assigner.plugins=[{plug}]")
    assert out["failed"] == ["crashy-s1"]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("compare/crash")
    bad = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("assigner") == "crashy"
           and r.data.tags.get("seed") == "1"]
    assert bad[0].info.status == "FAILED" and "credit exploded" in bad[0].data.tags["error"]
    report = (tmp_path / "crash" / "report" / "report.md").read_text()
    assert "crashy-s1 (failed" in report
    rows = {r["assigner"]: r for r in json.loads((tmp_path / "crash" / "report" / "report.json").read_text())["rows"]}
    assert rows["crashy"]["n"] == 1 and rows["grpo"]["n"] == 2 and rows["crashy"]["diff_n"] == 1


def test_report_from_a_remote_tracking_server(tmp_path, tiny_model_dir, mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    out, _ = _run(tmp_path, tiny_model_dir, "remote", "[grpo,entropy_adv]", "[0]", "trainer.max_steps=2")
    assert out["failed"] == []
    env = dict(os.environ, MLFLOW_TRACKING_URI=mlflow_server)
    rep = subprocess.run([sys.executable, "-m", "gearlab.cli", "report", "remote", f"trainer.output_dir={tmp_path / 'elsewhere'}"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert rep.returncode == 0, rep.stderr
    assert "entropy_adv" in rep.stdout and (tmp_path / "elsewhere" / "remote" / "report" / "report.md").is_file()
    assert not (tmp_path / "mlflow.db").exists()


def test_t_interval_golden_values():
    # n = 3, values 1, 2, 3: mean 2, s = 1, t_{0.975,2} = 4.302653 -> half-width 4.302653 / sqrt(3) = 2.484138
    m, hw = t_interval([1.0, 2.0, 3.0])
    assert m == 2.0 and hw == pytest.approx(2.484138, abs=1e-6)
    assert t_interval([0.5]) == (0.5, None)


def test_replay_reuses_the_cached_rollouts(tmp_path, tiny_model_dir):
    from gearlab.replay import load_rollouts, replay

    over = [f"model.name_or_path={tiny_model_dir}", f"trainer.output_dir={tmp_path}", f"replay.rollouts={tmp_path / 'r.pt'}",
            "replay.prompts=3", "rollout.group_size=4", "rollout.max_new_tokens=10", "replay.assigners=[grpo,gear,entropy_fork]"]
    first = replay(load_config(over))
    rb, problems, info = load_rollouts(tmp_path / "r.pt")
    assert rb.batch_size == 12 and len(problems) == 3 and info["group_size"] == 4
    m1 = json.loads((tmp_path / "r.replay.json").read_text())["metrics"]
    replay(load_config([*over, "trainer.seed=7"]))  # another seed: the cached file decides the rollouts
    m2 = json.loads((tmp_path / "r.replay.json").read_text())["metrics"]
    assert torch.equal(load_rollouts(tmp_path / "r.pt")[0].response_ids, rb.response_ids)
    assert m1 == m2 or all(abs(m1[k] - m2[k]) < 1e-9 or (m1[k] != m1[k]) for k in m1)
    assert m1["sign_diff_vs_grpo/gear"] == 0.0 and "top10_share/entropy_fork" in m1
    assert first["sequences"] == 12
