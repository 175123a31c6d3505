"""Paired comparisons: same data and sampling per seed, determinism, resumable, crash-tolerant,
and a report rebuilt from MLflow alone (local SQLite and a real remote server)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import mlflow
import pytest
import torch

from gearlab.commands.compare import compare
from gearlab.config import load_config
from gearlab.commands.report import _band, _bounds, build_report, t_interval
from gearlab.trainer.train import train


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
    return {
        k: [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, k), key=lambda m: m.step)] for k in keys
    }


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
        assert g["train/rollout_crc"][0] == e["train/rollout_crc"][0]  # the same sampled tokens
    assert h[("grpo", "0")]["train/data_crc"] != h[("grpo", "1")]["train/data_crc"]  # seeds differ
    assert "report/report.md" in [a.path for a in client.list_artifacts(parent.info.run_id, "report")]
    # MLflow 3's model-training kind tag, artifacts beside the db, versions on every run
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert exp.artifact_location == (tmp_path.resolve() / "mlartifacts" / "compare_pair").as_uri()
    assert all(r.data.tags["versions.torch"] == torch.__version__ for r in [parent, *kids.values()])
    assert {"grpo/final_mean", "entropy_adv/paired_diff"} <= set(parent.data.metrics)
    assert "pairing: exact — for each of 2 seed(s) with several children, their first rollouts are the same tokens" \
        in out["table"]
    table = out["table"].split("| method")[1].split("\n\n")[0]
    # the same table from MLflow alone, in a new process
    rep = subprocess.run([sys.executable, "-m", "gearlab.cli", "report", "pair", f"trainer.output_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    assert table.strip() in rep.stdout
    # any logged per-iteration metric can be plotted across methods, e.g. the credit statistics every run logs
    more = build_report(uri, "pair", more_curves=["credit/adv_std", "credit/nope"], out_dir=tmp_path / "more",
                        log_to_parent=False)
    assert (tmp_path / "more" / "curves_credit_adv_std.png").stat().st_size > 10_000
    assert "more curves: curves_credit_adv_std.png" in more.table and "no run logged 'credit/nope'" in more.table
    # re-running skips every finished child
    out2, _ = _run(tmp_path, tiny_model_dir, "pair", "[grpo,entropy_adv]", "[0,1]")
    assert "4 already finished, 0 to run" in capsys.readouterr().out
    # the shared start is pinned by its digest: resuming from other weights (a warm start redone elsewhere) is refused
    from gearlab.config import ConfigError
    from gearlab.models.checkpoints import weights_digest
    from gearlab.models.tiny import make_tiny

    assert parent.data.tags["start_sha256"] == weights_digest(tiny_model_dir)
    other = make_tiny(tmp_path / "other", seed=1)
    assert weights_digest(other) != weights_digest(tiny_model_dir) and weights_digest(tmp_path) is None
    with pytest.raises(
        ConfigError, match="key 'model.name_or_path': the starting weights .* are not those comparison 'pair'"
    ):
        _run(tmp_path, other, "pair", "[grpo,entropy_adv]", "[0,1]")


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


def test_a_time_limited_comparison_stops_resumably_and_a_lost_checkpoint_restarts_clean(
    tmp_path, tiny_model_dir, capsys
):
    """compare.max_minutes: queued children are not started once it has passed; a child past trainer.deadline stops
    at an iteration boundary (as for trainer.stop_after). A store moved without the child's folder (another machine) \
restarts that child from
    iteration 0 and deletes its stale MLflow run, so the report holds one complete run per (method, seed)."""
    out, _ = _run(tmp_path, tiny_model_dir, "limit", "[grpo]", "[0,1]", "compare.max_minutes=1e-9")
    assert out["interrupted"] and out["stopped"] == ["grpo-s0"] and not (
        tmp_path / "limit" / "grpo-s0" / "checkpoints"
    ).exists()
    # with parallel workers the queued children are cancelled, not recorded as failed runs
    out, _ = _run(
        tmp_path, tiny_model_dir, "limit", "[grpo,gear]", "[0,1,2]", "compare.max_minutes=1e-9", "compare.workers=2"
    )
    assert out["interrupted"] and out["failed"] == [] and out["stopped"]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("compare/limit")
    assert [r for r in client.search_runs([exp.experiment_id]) if "assigner" in r.data.tags] == []
    out, _ = _run(tmp_path, tiny_model_dir, "limit", "[grpo]", "[0,1]", "trainer.stop_after=1")  # one iteration in
    assert out["interrupted"] and out["stopped"] == ["grpo-s0"]
    (stale,) = [r for r in client.search_runs([exp.experiment_id]) if "assigner" in r.data.tags]
    assert stale.info.status == "KILLED" and [
        m.step for m in client.get_metric_history(stale.info.run_id, "train/reward")
    ] == [0]
    import shutil

    shutil.rmtree(tmp_path / "limit" / "grpo-s0")  # the checkpoint did not travel with the store
    capsys.readouterr()
    out, _ = _run(tmp_path, tiny_model_dir, "limit", "[grpo]", "[0,1]")
    assert out["failed"] == [] and not out.get("interrupted")
    assert f"grpo-s0: no local checkpoint for its unfinished MLflow run {stale.info.run_id}" in capsys.readouterr().out
    kids = [r for r in client.search_runs([exp.experiment_id]) if "assigner" in r.data.tags]
    assert sorted(
        r.data.tags["seed"] for r in kids
    ) == ["0", "1"] and stale.info.run_id not in {r.info.run_id for r in kids}
    for r in kids:
        assert r.info.status == "FINISHED"
        assert sorted(m.step for m in client.get_metric_history(r.info.run_id, "train/reward")) == [0, 1, 2]


def test_report_from_a_remote_tracking_server(tmp_path, tiny_model_dir, mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    out, _ = _run(tmp_path, tiny_model_dir, "remote", "[grpo,entropy_adv]", "[0]", "trainer.max_steps=2")
    assert out["failed"] == []
    env = dict(os.environ, MLFLOW_TRACKING_URI=mlflow_server)
    rep = subprocess.run([sys.executable, "-m", "gearlab.cli", "report", "remote",
                         f"trainer.output_dir={tmp_path / 'elsewhere'}"],
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
    from gearlab.commands.replay import load_rollouts, replay

    over = [f"model.name_or_path={tiny_model_dir}", f"trainer.output_dir={tmp_path}",
            f"replay.rollouts={tmp_path / 'r.pt'}",
            "replay.prompts=3", "rollout.group_size=4", "rollout.max_new_tokens=10",
            "replay.assigners=[grpo,gear,entropy_fork]"]
    first = replay(load_config(over))
    rb, problems, info = load_rollouts(tmp_path / "r.pt")
    assert rb.batch_size == 12 and len(problems) == 3 and info["group_size"] == 4
    m1 = json.loads((tmp_path / "r.replay.json").read_text())["metrics"]
    replay(load_config([*over, "trainer.seed=7"]))  # another seed: the cached file decides the rollouts
    m2 = json.loads((tmp_path / "r.replay.json").read_text())["metrics"]
    assert torch.equal(load_rollouts(tmp_path / "r.pt")[0].response_ids, rb.response_ids)
    assert m1.keys() == m2.keys()
    # a metric that is undefined on this batch (NaN) must be undefined on the replay too, not excuse a difference
    assert [
        k for k in m1 if not (m1[k] == pytest.approx(m2[k], abs=1e-9) or (math.isnan(m1[k]) and math.isnan(m2[k])))
    ] == []
    assert m1["sign_diff_vs_grpo/gear"] == 0.0 and "top10_share/entropy_fork" in m1
    assert first["sequences"] == 12


# --- reports from comparisons made directly in MLflow (no training: fast) ---

def _fake_comparison(tmp_path, name, children, *, baseline="grpo"):
    """A comparison as ``gearlab compare`` records it, made directly with an MlflowClient. children:
    {(assigner, seed): (final eval/greedy_accuracy, train/accuracy curve, extra tags)}; returns (uri, client, parent \
id)."""
    from gearlab.trainer.provenance import version_tags
    from gearlab.trainer.tracking import ensure_experiment

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    exp_id = ensure_experiment(uri, f"compare/{name}", client)
    assigners = list(dict.fromkeys(a for a, _ in children))
    seeds = sorted({s for _, s in children})
    parent = client.create_run(exp_id, run_name=name, tags={
        "comparison_id": name, "gearlab.role": "parent", "assigners": ",".join(assigners),
        "seeds": ",".join(map(str, seeds)), "baseline": baseline, **version_tags()})
    pid = parent.info.run_id
    for (a, s), (final, curve, tags) in children.items():
        r = client.create_run(exp_id, run_name=f"{name}/{a}-s{s}", tags={
            "comparison_id": name, "assigner": a, "seed": str(s), "mlflow.parentRunId": pid, **tags})
        for i, v in enumerate(curve):
            client.log_metric(r.info.run_id, "train/accuracy", v, step=i)
        client.log_metric(r.info.run_id, "eval/greedy_accuracy", final, step=len(curve))
        client.set_terminated(r.info.run_id, "FINISHED")
    return uri, client, pid


def _tags(**over):
    from gearlab.trainer.provenance import version_tags

    return {"git_sha": over.pop("git_sha", "abc123"), **version_tags(), "versions.gearlab": "abc123",
            **{f"versions.{k}": v for k, v in over.items()}}


def test_report_warns_when_children_differ_in_versions(tmp_path):
    from gearlab.trainer.provenance import package_versions

    have = package_versions()["transformers"]
    old = {k: v for k, v in _tags().items() if not k.startswith("versions.")}  # a run from before the tags
    uri, _, _ = _fake_comparison(tmp_path, "mixed", {
        ("grpo", 0): (0.5, [0.1, 0.2], _tags()), ("gear", 0): (0.6, [0.1, 0.3], _tags()),
        ("grpo", 1): (0.4, [0.1, 0.2], old), ("gear", 1): (0.7, [0.2, 0.4], _tags(transformers="9.9.9"))})
    rep = build_report(uri, "mixed", out_dir=tmp_path / "rep")
    line = f"WARNING: runs differ in versions.transformers ({have}: grpo-s0, gear-s0; 9.9.9: gear-s1; unknown: grpo-s1)"
    assert rep.warnings[0] == line and line in rep.table and line in rep.markdown_path.read_text()
    assert sum(w.startswith("WARNING") for w in rep.warnings) == 1  # the old run alone is no mismatch
    assert any("grpo-s1" in w and "unknown" in w for w in rep.warnings[1:])
    js = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert js["version_mismatch"] == [{"key": "versions.transformers", "values": {
        have: ["grpo-s0", "gear-s0"], "9.9.9": ["gear-s1"], "unknown": ["grpo-s1"]}}]
    assert js["versions_unknown"] == ["grpo-s1"]
    # another commit of gearlab is a mismatch too, in git_sha (an old run's git_sha tag counts)
    uri2, _, _ = _fake_comparison(tmp_path / "b", "code", {
        ("grpo", 0): (0.5, [0.1], _tags()), ("gear", 0): (0.6, [0.1], {"git_sha": "def456"})})
    rep2 = build_report(uri2, "code", out_dir=tmp_path / "rep2")
    assert rep2.version_mismatch == [{"key": "git_sha", "values": {"abc123": ["grpo-s0"], "def456": ["gear-s0"]}}]
    assert "WARNING: runs differ in git_sha (abc123: grpo-s0; def456: gear-s0)" in rep2.table


def test_report_is_quiet_when_children_agree(tmp_path):
    uri, _, _ = _fake_comparison(tmp_path, "same", {
        (a, s): (0.5 + 0.1 * s, [0.1, 0.2], _tags()) for a in ("grpo", "gear") for s in (0, 1)})
    rep = build_report(uri, "same", out_dir=tmp_path / "rep")
    assert rep.warnings == [] and rep.version_mismatch == [] and "WARNING" not in rep.table
    assert json.loads((tmp_path / "rep" / "report.json").read_text())["version_mismatch"] == []


def test_parent_run_gets_the_headline_metrics(tmp_path):
    finals = {("grpo", 0): 0.5, ("grpo", 1): 0.3, ("gear", 0): 0.6, ("gear", 1): 0.6, ("pass@k", 0): 0.1}
    uri, client, pid = _fake_comparison(tmp_path, "head", {k: (v, [0.1, 0.2], _tags()) for k, v in finals.items()})
    rep = build_report(uri, "head", out_dir=tmp_path / "rep")
    for _ in range(2):  # re-building the report logs the same numbers again, at step 0
        m = client.get_run(pid).data.metrics
        rows = {r["assigner"]: r for r in rep.rows}
        assert m["grpo/final_mean"] == pytest.approx(0.4) and m["grpo/n"] == 2
        # two seeds are too few for an interval: none is logged, and the row says why
        assert "grpo/final_ci95" not in m and rows["grpo"]["ci95_note"] == "n too small"
        assert rows["gear"]["ci95_note"] == "no spread, interval undefined"  # 0.6 on both seeds
        assert m["gear/final_mean"] == pytest.approx(0.6) and m["gear/paired_diff"] == pytest.approx(0.2)
        assert "gear/paired_ci95" not in m and rows["gear"]["diff_note"] == "n too small" and m["gear/paired_n"] == 2
        assert "grpo/paired_diff" not in m  # the baseline has no difference to itself
        assert m["pass_at_k/final_mean"] == pytest.approx(0.1) and "pass_at_k/final_ci95" not in m  # n = 1: no interval
        assert {m_.step for m_ in client.get_metric_history(pid, "gear/final_mean")} == {0}
        rep = build_report(uri, "head", out_dir=tmp_path / "rep")
    arts = [a.path for a in client.list_artifacts(pid, "report")]
    assert {"report/report.md", "report/report.json", "report/curves.png"} <= set(arts)


def test_report_is_the_parent_runs_description_and_the_summary_opens_the_runs(tmp_path, monkeypatch):
    """report.md becomes the parent run's description (the tag the MLflow UI shows on the run's page), and the closing
    lines give the address of the experiment's runs, the task keys in the inspect line."""
    from gearlab.commands.closing import compare_summary

    uri, client, pid = _fake_comparison(tmp_path, "desc", {(a, s): (0.5, [0.1, 0.2], _tags()) for a in ("grpo", "gear")
                                                         for s in (0, 1, 2)})
    rep = build_report(uri, "desc", out_dir=tmp_path / "rep")
    assert client.get_run(pid).data.tags["mlflow.note.content"] == rep.markdown_path.read_text()
    exp_id = client.get_experiment_by_name("compare/desc").experiment_id
    monkeypatch.chdir(tmp_path)
    cfg = load_config(
        [f"trainer.output_dir={tmp_path}", "compare.name=desc", "task=arith_hard", "rollout.group_size=4"]
    )
    lines = compare_summary(cfg).splitlines()
    assert lines[1] == (f"look at them: mlflow ui --backend-store-uri sqlite:///mlflow.db, then open "
                        f"http://127.0.0.1:5000/#/experiments/{exp_id}/runs?workflowType=machine_learning  "
                        f"(experiment compare/desc; the comparison's report is the parent run's description)")
    assert lines[2] == (f"see credit on one batch: gearlab inspect task=arith_hard "
                        f"model.name_or_path={tmp_path / 'desc' / 'grpo-s0' / 'final'} rollout.group_size=4")


def test_a_long_report_is_cut_at_a_line_to_fit_the_description():
    from gearlab.commands.report import run_description

    assert run_description("short\n") == "short\n"
    text = "".join(f"line {i:04d}\n" for i in range(2000))  # 20,000 characters
    out = run_description(text)
    assert len(out) <= 8000 and out.startswith("line 0000\nline 0001\n")
    assert out.endswith("\nline 0789\n\n… (cut to fit MLflow's description limit: the full report is the artifact "
                        "report/report.md)\n")


def test_accuracy_bands_stay_within_0_and_1():
    series = [[0.0, 0.0, 0.1, 1.0], [0.0, 0.5, 0.9, 1.0], [0.0, 0.0, 1.0, 0.6]]
    mean, lo, hi = _band(series)
    assert min(lo) < 0 and max(hi) > 1  # the plain t band leaves [0, 1]
    mean_c, lo_c, hi_c = _band(series, _bounds("train/accuracy"))
    assert mean_c == mean and all(0.0 <= v <= 1.0 for v in lo_c + hi_c)
    assert all(a <= m <= b for a, m, b in zip(lo_c, mean_c, hi_c))
    assert _bounds("eval/greedy_accuracy") == _bounds("eval/pass@4") == _bounds("eval/pass_at_4") == (0.0, 1.0)
    assert _bounds("eval/avg@8") == (0.0, 1.0)
    assert _bounds("train/reward", [0.0, 1.0, 0.5]) == (0.0, 1.0) and _bounds("train/reward", [-0.5, 2.0]) is None
    assert _bounds("update/loss", [0.1, 0.2]) is None



def test_report_shows_the_start_and_the_paired_change_from_it(tmp_path):
    """Each method's row says where its seeds started (the evaluation before the first iteration) and the
    paired change since, with its t-interval: does the method learn at all?"""
    from gearlab.commands.report import build_report

    finals = {
        ("grpo", 0): 0.30, ("grpo", 1): 0.40, ("grpo", 2): 0.20, ("gear", 0): 0.10, ("gear", 1): 0.20, ("gear", 2): 0.30
    }
    starts = {0: 0.20, 1: 0.30, 2: 0.20}
    uri, client, pid = _fake_comparison(tmp_path, "learn", {k: (v, [0.1, 0.2], _tags()) for k, v in finals.items()})
    for r in client.search_runs([client.get_experiment_by_name("compare/learn").experiment_id]):
        if "seed" in r.data.tags:
            client.log_metric(r.info.run_id, "eval/greedy_accuracy", starts[int(r.data.tags["seed"])], step=0)
    rep = build_report(uri, "learn", out_dir=tmp_path / "rep")
    rows = {r["assigner"]: r for r in rep.rows}
    assert rows["grpo"]["start"] == pytest.approx(0.7 / 3) and rows["grpo"]["change_n"] == 3
    assert rows["grpo"]["change"] == pytest.approx((0.1 + 0.1 + 0.0) / 3)  # paired per seed: final − start
    assert rows["gear"]["change"] == pytest.approx((-0.1 - 0.1 + 0.1) / 3)
    from gearlab.commands.report import t_interval

    assert rows["gear"]["change_ci95"] == pytest.approx(t_interval([-0.1, -0.1, 0.1])[1])
    assert "start" in rep.table and "change from start" in rep.table and "23.3" in rep.table


HASHED_TASK = '''
import hashlib

from gearlab.tasks import register_task
from gearlab.tasks.arithmetic import ArithmeticTask


@register_task("arith_hashed")
class HashedRewardArithmetic(ArithmeticTask):
    """The arithmetic prompts, rewarded 0 or 1 by a hash of the completion: a random model's samples differ in
    reward, so its updates are not all zero."""

    def reward(self, problem, completion):
        return float(hashlib.sha256(completion.encode()).digest()[0] % 2)
'''


def test_worker_pool_gives_the_in_process_numbers(tmp_path, tiny_model_dir, capsys):
    """workers=2 (two long-lived spawned processes, several children each) records exactly the metrics of
    workers=1 (every child in this process, one after another), and keeps each child's output in its train.log."""
    plug = tmp_path / "hashed_task.py"
    plug.write_text(HASHED_TASK)
    # the random tiny model never answers right: with the real reward every update is zero and so proves nothing
    common = ["trainer.threads=1", "task.name=arith_hashed", f"task.plugins=[{plug}]"]
    _run(tmp_path / "seq", tiny_model_dir, "pool", "[grpo,gear]", "[0,1]", *common)
    # compare.gpus: each worker sees one card of the list (here ids no CPU process touches), recorded on its runs
    out, _ = _run(tmp_path / "par", tiny_model_dir, "pool", "[grpo,gear]", "[0,1]", *common, "compare.workers=2",
                  "compare.gpus=[5,7]")
    assert out["failed"] == []
    hist, cards = {}, []
    for d in ("seq", "par"):
        client = mlflow.MlflowClient(f"sqlite:///{tmp_path / d / 'mlflow.db'}")
        exp = client.get_experiment_by_name("compare/pool")
        hist[d] = {(r.data.tags["assigner"], r.data.tags["seed"]): _histories(client, r.info.run_id, (
                       "train/reward", "train/response_len", "eval/", "update/pg_loss", "update/grad_norm",
                       "update/clipfrac"))
                   for r in client.search_runs([exp.experiment_id]) if "assigner" in r.data.tags}
        cards.append(sorted(r.data.tags.get("cuda_visible_devices", "-") for r in client.search_runs(
            [exp.experiment_id]) if "assigner" in r.data.tags))
    assert len(hist["par"]) == 4 and hist["par"] == hist["seq"]
    assert cards[0] == ["-"] * 4 and set(cards[1]) == {"5", "7"}  # both workers ran children, each on its card
    h = hist["seq"][("gear", "1")]
    assert {"train/reward", "train/response_len", "eval/greedy_accuracy", "update/pg_loss", "update/grad_norm",
            "update/clipfrac"} <= h.keys()  # every prefix compared above names metrics that were logged
    assert any(v != 0 for _, v in h["update/grad_norm"])  # ... and the updates compared were not all zero
    log = (tmp_path / "par" / "pool" / "gear-s1" / "train.log").read_text()
    assert "done" not in capsys.readouterr().out.split("to run")[1]  # children's output stays off the console
    assert log.strip()  # ... and lands in the child's log


def test_a_comparison_run_in_parts_reports_the_whole_design(tmp_path):
    """A comparison started with part of its design (3 methods, 3 seeds in a first session) and resumed with all of
    it: the parent's design tags, which the report's table follows, become the union, in the first order."""
    from gearlab.commands.compare import _extend_design
    from gearlab.commands.report import _design

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("compare/parts")
    parent = client.create_run(exp, tags={"methods_json": '["gear", "gear_random", "grpo"]', "seeds": "0,1,2",
                                          "baseline": "grpo", "gearlab.role": "parent"})
    assert _extend_design(client, parent, ["gear", "grpo"], [0]) is parent  # a subset changes nothing
    grown = _extend_design(client, parent, ["oar_g", "gear", "rlsd", "gear_random", "grpo"], [0, 1, 2, 3, 4])
    assert _design(grown, [], None) == ("grpo", ["gear", "gear_random", "grpo", "oar_g", "rlsd"], [0, 1, 2, 3, 4])
    assert client.get_run(parent.info.run_id).data.tags["assigners"] == "gear,gear_random,grpo,oar_g,rlsd"


def test_workers_are_spread_round_robin_over_the_gpus():
    from gearlab.commands.compare_pool import worker_gpus

    assert worker_gpus(6, None, None, 2) == ["0", "1", "0", "1", "0", "1"]  # 3 children per card on a 2-GPU host
    assert worker_gpus(3, None, "4,6", 8) == ["4", "6", "4"]  # the comparison's own CUDA_VISIBLE_DEVICES is kept
    assert worker_gpus(3, [2], None, 8) == ["2", "2", "2"]  # named: every worker on GPU 2
    # nothing to spread: one worker, one card, no card (CPU), or pinning switched off
    assert worker_gpus(1, None, None, 2) is None and worker_gpus(3, None, None, 1) is None
    assert worker_gpus(3, None, None, 0) is None and worker_gpus(3, [], None, 2) is None


def test_grid_expands_into_methods_with_their_own_runs(tmp_path):
    from gearlab.commands.compare import methods_of, plan, primary_metric
    from gearlab.config import ConfigError, load_config

    cfg = load_config(["compare.assigners=[grpo,gear,gear_random]", "compare.grid.gear.q_on=[0.8,0.95]",
                       "compare.grid.gear.beta=[2]"])
    names = methods_of(cfg)
    assert names == ["grpo", "gear:q_on=0.8,beta=2", "gear:q_on=0.95,beta=2", "gear_random"]
    children = plan(cfg, [], "m", "p", names)
    # seed-major, the baseline (compare.baseline=grpo) last within each seed
    assert [c.label for c in children[:5]] == [
        "gear:q_on=0.8,beta=2-s0", "gear:q_on=0.95,beta=2-s0", "gear_random-s0", "grpo-s0", "gear:q_on=0.8,beta=2-s1"
    ]
    child = load_config([o for o in children[1].overrides if not o.startswith("model.")])
    # the child's run is its own method (tag `assigner` = the label) built from gear with the grid's options
    assert (child.assigner.name, child.assigner.base) == ("gear:q_on=0.95,beta=2", "gear")
    assert child.assigner.options.q_on == 0.95 and child.assigner.options.beta == 2
    rnd = load_config([o for o in children[2].overrides if not o.startswith("model.")])
    assert (
        rnd.assigner.name, rnd.assigner.base, rnd.assigner.options.segmentation
    ) == ("gear_random", "gear", "random")
    # the metric's name as MLflow stores it ("@" is not allowed there): the one name logged, looked up and documented
    assert primary_metric(cfg) == "eval/avg_at_4" and primary_metric(load_config(["eval.k=8"])) == "eval/avg_at_8"
    assert primary_metric(load_config(["compare.metric=eval/pass@4"])) == "eval/pass_at_4"
    with pytest.raises(ConfigError, match="compare.assigners"):
        methods_of(load_config(["compare.assigners=[grpo,nope]"]))
    with pytest.raises(ConfigError, match="compare.grid.gear"):
        methods_of(load_config(["compare.assigners=[grpo]", "compare.grid.gear=3"]))


def test_a_pretrained_model_is_warm_started_once_and_every_child_starts_there(tmp_path, tiny_model_dir, capsys):
    """compare.warm_start: the pretrained folder is fine-tuned on the task's demonstrations before any child runs,
    the children train from that folder, and the parent pins its digest (what a resumed call is checked against)."""
    from gearlab.models.checkpoints import weights_digest

    extra = ("compare.warm_start=true", "warmstart.steps=3", "warmstart.batch_size=4", "warmstart.lr=1e-3",
             "warmstart.n_eval=0", "trainer.max_steps=1")
    out, cfg = _run(tmp_path, tiny_model_dir, "ws", "[grpo]", "[0]", *extra)
    assert out["failed"] == []
    ws = tmp_path / "warmstart" / f"{tiny_model_dir.name}-arith"
    assert json.loads((ws / "warmstart.json").read_text())["steps"] == 3
    assert weights_digest(ws) != weights_digest(tiny_model_dir)
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("compare/ws").experiment_id])
    parent = next(r for r in runs if r.data.tags.get("gearlab.role") == "parent")
    child = next(r for r in runs if r.data.tags.get("assigner") == "grpo")
    assert parent.data.tags["start_sha256"] == weights_digest(ws)
    assert child.data.params["model.name_or_path"] == str(ws.resolve())
    assert "fine-tuning" in capsys.readouterr().out
    _run(tmp_path, tiny_model_dir, "ws", "[grpo]", "[0]", *extra)  # resumed: the warm start is not redone
    assert "fine-tuning" not in capsys.readouterr().out
