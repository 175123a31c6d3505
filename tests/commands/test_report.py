"""``gearlab report`` on comparisons written directly into MLflow (no training): the learning and power lines,
their numbers in report.json and on the parent run, the primary-metric fallback and the credit-eval table."""
from __future__ import annotations

import json
import math

import mlflow
import pytest

from gearlab.commands.report import build_report, credit_eval_table, t_interval
from gearlab.core.power import mde_paired, paired_sd, seeds_needed

STARTS = {0: 0.20, 1: 0.30, 2: 0.25}  # every method of a seed starts from the same checkpoint
FINALS = {"grpo": {0: 0.30, 1: 0.40, 2: 0.31}, "gear": {0: 0.34, 1: 0.42, 2: 0.38}, "rlsd": {0: 0.25, 1: 0.28, 2: 0.27}}


def _fake_comparison(tmp_path, name, finals, *, starts=STARTS, key="eval/greedy_accuracy", baseline="grpo",
                     primary_metric=None, steps=10):
    """A comparison as ``gearlab compare`` records it, made with an MlflowClient on a local SQLite store: a parent
    (comparison_id, gearlab.role=parent, assigners, seeds, baseline[, primary_metric]) and one FINISHED child per
    (assigner, seed) with ``key`` logged at step 0 (the start) and at ``steps`` (the final value).
    Returns (uri, client, parent id, {(assigner, seed): run id})."""
    from gearlab.trainer.tracking import ensure_experiment

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    exp_id = ensure_experiment(uri, f"compare/{name}", client)
    seeds = sorted({s for v in finals.values() for s in v})
    tags = {"comparison_id": name, "gearlab.role": "parent", "assigners": ",".join(finals),
            "seeds": ",".join(map(str, seeds)), "baseline": baseline}
    if primary_metric:
        tags["primary_metric"] = primary_metric
    pid = client.create_run(exp_id, run_name=name, tags=tags).info.run_id
    ids = {}
    for a, per_seed in finals.items():
        for s, final in per_seed.items():
            r = client.create_run(exp_id, run_name=f"{name}/{a}-s{s}", tags={
                "comparison_id": name, "assigner": a, "seed": str(s), "mlflow.parentRunId": pid})
            rid = r.info.run_id
            if s in starts:
                client.log_metric(rid, key, starts[s], step=0)
            client.log_metric(rid, key, final, step=steps)
            client.log_metric(rid, "train/accuracy", 0.1, step=0)
            client.set_terminated(rid, "FINISHED")
            ids[(a, s)] = rid
    return uri, client, pid, ids


def test_learning_and_power_numbers_and_lines(tmp_path):
    uri, client, pid, _ = _fake_comparison(tmp_path, "pow", FINALS)
    rep = build_report(uri, "pow", out_dir=tmp_path / "rep")
    js = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert js["primary_metric"] == js["metric"] == "eval/greedy_accuracy" and js["primary_metric_source"] == "default"
    assert js["power_settings"] == {"power": 0.8, "alpha": 0.05, "effect": 0.03}
    rows = {r["assigner"]: r for r in js["rows"]}
    # learning: the paired change final − start per seed
    g = rows["grpo"]["learning"]
    assert g["mean"] == pytest.approx((0.10 + 0.10 + 0.06) / 3) and g["n"] == 3
    assert g["half_width"] == pytest.approx(t_interval([0.10, 0.10, 0.06])[1]) == pytest.approx(0.0573687, abs=1e-6)
    assert rows["gear"]["learning"]["mean"] == pytest.approx(0.13)
    assert rows["gear"]["learning"]["half_width"] == pytest.approx(0.0248414, abs=1e-6)
    assert rows["grpo"]["change"] == pytest.approx(g["mean"])  # the old keys stay
    # paired: gear − grpo per seed = 0.04, 0.02, 0.07
    p = rows["gear"]["paired"]
    assert "paired" not in rows["grpo"]
    assert p["diff"] == pytest.approx(0.0433333, abs=1e-6) and p["n"] == 3
    assert p["half_width"] == pytest.approx(0.0625161, abs=1e-6)
    assert p["sd"] == pytest.approx(0.0251661, abs=1e-6) == pytest.approx(paired_sd([0.04, 0.02, 0.07]))
    assert p["mde80"] == pytest.approx(0.0821433, abs=1e-6) == pytest.approx(3.264044 * p["sd"], rel=1e-6)
    assert p["n_needed"] == 8 == seeds_needed(0.03, p["sd"])
    assert rows["gear"]["diff"] == pytest.approx(p["diff"]) and rows["gear"]["diff_n"] == 3  # old keys
    r = rows["rlsd"]["paired"]  # rlsd − grpo = −0.05, −0.12, −0.04
    assert r["diff"] == pytest.approx(-0.07) and r["sd"] == pytest.approx(paired_sd([-0.05, -0.12, -0.04]))
    assert r["mde80"] == pytest.approx(mde_paired(r["sd"], 3)) and r["n_needed"] == seeds_needed(0.03, r["sd"])
    # the lines under the table, in points for an accuracy
    learning = ("learning: grpo +8.7 ± 5.7 points (n=3, excludes 0); gear +13.0 ± 2.5 points (n=3, excludes 0); "
                "rlsd +1.7 ± 8.7 points (n=3, includes 0)")
    power = ("power: gear vs grpo: paired SD 2.5 points (n=3); smallest difference detectable at 80% power "
             "(two-sided α=0.05): 8.2 points; detecting 3 points needs 8 seeds")
    md = rep.markdown_path.read_text()
    for line in (learning, power):
        assert line in rep.table.splitlines() and line in md
    rl = next(line for line in rep.table.splitlines() if line.startswith("power: rlsd vs grpo: "))
    assert f"paired SD {100 * r['sd']:.1f} points (n=3)" in rl and f"needs {r['n_needed']} seeds" in rl
    assert rep.table.index("| method") < rep.table.index("learning:") < rep.table.index("power: gear")
    assert "MDE80" in rep.table and "8.2" in rep.table  # the compact column
    # the parent run gets the new headline numbers
    m = client.get_run(pid).data.metrics
    assert m["gear/paired_sd"] == pytest.approx(p["sd"]) and m["gear/mde80"] == pytest.approx(p["mde80"])
    assert m["gear/n_needed"] == 8 and m["grpo/learning_mean"] == pytest.approx(g["mean"])
    assert m["grpo/learning_ci95"] == pytest.approx(g["half_width"])
    assert "grpo/paired_sd" not in m and "grpo/mde80" not in m
    assert js["credit_eval"] is None and "credit vs known errors" not in rep.table  # no artifacts: no table


def test_a_larger_effect_needs_fewer_seeds_and_one_seed_has_no_power(tmp_path):
    uri, _, _, _ = _fake_comparison(tmp_path, "eff", {"grpo": {0: 0.3, 1: 0.4, 2: 0.31},
                                                       "gear": {0: 0.34, 1: 0.42, 2: 0.38}, "solo": {0: 0.5}})
    rep = build_report(uri, "eff", out_dir=tmp_path / "rep", effect=0.1, log_to_parent=False)
    rows = {r["assigner"]: r for r in rep.rows}
    assert rows["gear"]["paired"]["n_needed"] == seeds_needed(0.1, rows["gear"]["paired"]["sd"]) == 3
    assert "detecting 10 points needs 3 seeds" in rep.table
    assert rows["solo"]["paired"] == {"diff": pytest.approx(0.2), "half_width": None, "sd": None, "mde80": None,
                                      "n_needed": None, "n": 1, "note": "n too small"}
    assert "power: solo vs grpo: not computable (n=1 paired seeds; the paired SD needs at least 2)" in rep.table
    assert rows["solo"]["learning"] == {"mean": pytest.approx(0.3), "half_width": None, "n": 1, "note": "n too small"}
    assert "solo +30.0 points (n=1, n too small)" in rep.table


def test_two_seeds_with_identical_changes_give_no_interval_and_no_power(tmp_path):
    """n = 2 and every seed moving by exactly the same amount: no "± 0.0 (excludes 0)", no MDE of 0; the reasons
    instead, in the lines, the table cells, report.json and (by their absence) the parent's metrics."""
    starts = {0: 0.300, 1: 0.500}
    finals = {"grpo": {0: 0.294, 1: 0.494}, "gear": {0: 0.294, 1: 0.494}}  # −0.6 points on both seeds, both methods
    uri, client, pid, _ = _fake_comparison(tmp_path, "flat", finals, starts=starts)
    rep = build_report(uri, "flat", out_dir=tmp_path / "rep")
    lines = rep.table.splitlines()
    assert ("learning: grpo -0.6 points (n=2, no spread, interval undefined); "
            "gear -0.6 points (n=2, no spread, interval undefined)") in lines
    assert ("power: gear vs grpo: not computable (n=2 paired seeds, no spread: every seed gave the same difference, "
            "so the paired SD is 0)") in lines
    assert "excludes 0" not in rep.table and "± 0.0" not in rep.table
    gear_row = next(line for line in lines if line.startswith("| gear "))
    assert "0.0 (n=2, no spread, interval undefined)" in gear_row  # the Δ cell
    assert "-0.6 (n=2, no spread, interval undefined)" in gear_row  # the change-from-start cell
    assert "39.4 (n=2, n too small)" in gear_row  # the final column: two different finals, too few for an interval
    js = {r["assigner"]: r for r in json.loads((tmp_path / "rep" / "report.json").read_text())["rows"]}
    assert js["gear"]["paired"] == {"diff": pytest.approx(0.0), "half_width": None, "sd": pytest.approx(0.0),
                                    "mde80": None, "n_needed": None, "n": 2, "note": "no spread, interval undefined"}
    m = client.get_run(pid).data.metrics
    assert "grpo/learning_ci95" not in m and "gear/mde80" not in m and "gear/paired_ci95" not in m
    assert m["grpo/learning_mean"] == pytest.approx(-0.006)


def test_two_seeds_with_spread_are_too_few_for_an_interval(tmp_path):
    uri, _, _, _ = _fake_comparison(tmp_path, "two", {"grpo": {0: 0.30, 1: 0.40}, "gear": {0: 0.34, 1: 0.42}},
                                    starts={0: 0.20, 1: 0.30})
    rep = build_report(uri, "two", out_dir=tmp_path / "rep", log_to_parent=False)
    assert "learning: grpo +10.0 points (n=2, no spread, interval undefined); gear +13.0 points (n=2, n too small)" \
        in rep.table.splitlines()
    gear = {r["assigner"]: r for r in rep.rows}["gear"]
    assert gear["paired"]["half_width"] is None and gear["paired"]["note"] == "n too small"
    assert "3.0 (n=2, n too small)" in next(line for line in rep.table.splitlines() if line.startswith("| gear "))
    # the power line still states what two seeds could detect (a planning number, not a claim about this Δ)
    assert gear["paired"]["mde80"] == pytest.approx(mde_paired(paired_sd([0.04, 0.02]), 2))


def test_avg_at_k_is_reported_under_its_mlflow_name_also_when_named_with_an_at(tmp_path):
    """Runs log eval/avg_at_4 (MLflow allows no "@"); a parent made before that named it eval/avg@4: the report finds
    the values and shows the one name on record."""
    uri, _, _, _ = _fake_comparison(tmp_path, "avg", FINALS, key="eval/avg_at_4", primary_metric="eval/avg@4")
    rep = build_report(uri, "avg", out_dir=tmp_path / "rep", log_to_parent=False)
    js = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert js["metric"] == "eval/avg_at_4" and js["primary_metric_source"] == "parent tag primary_metric"
    assert {r["assigner"]: r["mean"] for r in rep.rows} == {"grpo": pytest.approx(1.01 / 3),
                                                            "gear": pytest.approx(0.38),
                                                             "rlsd": pytest.approx(0.8 / 3)}
    assert rep.table.splitlines()[0].startswith("| method | final eval/avg_at_4 (%) |")
    assert "eval/avg@4" not in rep.table


def test_primary_metric_comes_from_the_parent_tag_unless_given(tmp_path):
    finals = {"grpo": {0: 1.0, 1: 2.0, 2: 1.5}, "gear": {0: 1.5, 1: 2.1, 2: 2.3}}
    starts = {0: 0.5, 1: 0.5, 2: 0.5}
    uri, client, _, ids = _fake_comparison(tmp_path, "prim", finals, starts=starts, key="train/reward",
                                           primary_metric="train/reward")
    for (a, s), rid in ids.items():  # the default metric exists too, with other values
        client.log_metric(rid, "eval/greedy_accuracy", 0.9, step=10)
    rep = build_report(uri, "prim", out_dir=tmp_path / "rep", log_to_parent=False)
    js = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert js["primary_metric"] == js["metric"] == "train/reward"
    assert js["primary_metric_source"] == "parent tag primary_metric"
    rows = {r["assigner"]: r for r in rep.rows}
    assert rows["grpo"]["mean"] == pytest.approx(1.5) and rows["gear"]["paired"]["diff"] == pytest.approx(
        0.4667, abs=1e-4
    )
    sd = paired_sd([0.5, 0.1, 0.8])
    # raw units for a metric that is not a fraction shown in percent
    assert (f"power: gear vs grpo: paired SD {sd:.3g} (n=3); smallest difference detectable at 80% power "
            f"(two-sided α=0.05): {mde_paired(sd, 3):.3g}; detecting 0.03 needs {seeds_needed(0.03, sd)} "
            "seeds") in rep.table
    assert "learning: grpo +1 ± " in rep.table and "points" not in rep.table.split("learning:")[1]
    # the explicit argument wins over the tag
    rep2 = build_report(uri, "prim", metric="eval/greedy_accuracy", out_dir=tmp_path / "rep2", log_to_parent=False)
    js2 = json.loads((tmp_path / "rep2" / "report.json").read_text())
    assert js2["primary_metric"] == "eval/greedy_accuracy" and js2["primary_metric_source"] == "argument"
    assert {r["assigner"]: r["mean"] for r in rep2.rows} == {"grpo": pytest.approx(0.9), "gear": pytest.approx(0.9)}


def _credit_file(tmp_path, name, data):
    d = tmp_path / name
    d.mkdir()
    (d / "credit_eval.json").write_text(json.dumps(data))
    return d / "credit_eval.json"


CE_A = {"task": "arith3", "model": "tiny", "n_trajectories": 64, "n_failed_located": 20,
        "assigners": {"grpo": {"auroc": 0.5, "blame_ratio": 1.0, "prefix_share": 0.6, "n": 20},
                      "gear": {"auroc": 0.8, "blame_ratio": 2.0, "prefix_share": 0.3, "onset_precision": 0.7,
                               "onset_recall": 0.5, "n": 20}},
        "signals": {"entropy": {"auroc": 0.6}, "saliency": {"auroc": 0.55}}}
CE_B = {"task": "arith3", "model": "tiny", "n_trajectories": 64, "n_failed_located": 24,
        "assigners": {"grpo": {"auroc": 0.5, "blame_ratio": 1.0, "prefix_share": 0.6, "n": 24},
                      "gear": {"auroc": 0.7, "blame_ratio": 3.0, "prefix_share": 0.2, "onset_precision": 0.9,
                               "onset_recall": 0.7, "n": 24}},
        "signals": {"entropy": {"auroc": 0.7}}}


def test_credit_eval_table_over_the_childrens_artifacts(tmp_path):
    uri, client, _, ids = _fake_comparison(tmp_path, "ce", FINALS)
    client.log_artifact(ids[("gear", 0)], str(_credit_file(tmp_path, "a", CE_A)), "credit_eval")
    client.log_artifact(ids[("gear", 1)], str(_credit_file(tmp_path, "b", CE_B)), "credit_eval")
    client.log_artifact(ids[("grpo", 0)], str(_credit_file(tmp_path, "c", CE_A)), "elsewhere")  # not the path: ignored
    rep = build_report(uri, "ce", out_dir=tmp_path / "rep")
    js = json.loads((tmp_path / "rep" / "report.json").read_text())
    ce = js["credit_eval"]
    assert ce == rep.credit_eval and ce["runs"] == ["gear-s0", "gear-s1"] and ce["n_files"] == 2
    assert ce["n_trajectories"] == 128 and ce["n_failed_located"] == 44 and ce["tasks"] == ["arith3"]
    gear = ce["assigners"]["gear"]
    assert gear["auroc"]["mean"] == pytest.approx(0.75) and gear["auroc"]["n"] == 2
    assert gear["auroc"]["half_width"] == pytest.approx(t_interval([0.8, 0.7])[1]) == pytest.approx(0.635310, abs=1e-5)
    assert gear["blame_ratio"]["mean"] == pytest.approx(2.5) and gear["prefix_share"]["mean"] == pytest.approx(0.25)
    assert gear["onset_precision"]["mean"] == pytest.approx(0.8) and gear["onset_recall"]["mean"] == pytest.approx(0.6)
    assert gear["n_scored"] == 44 and gear["n_files"] == 2
    grpo = ce["assigners"]["grpo"]
    assert grpo["auroc"] == {"mean": 0.5, "half_width": 0.0, "n": 2} and "onset_precision" not in grpo
    assert ce["signals"]["entropy"]["auroc"]["mean"] == pytest.approx(0.65)
    assert ce["signals"]["saliency"]["auroc"] == {"mean": 0.55, "half_width": None, "n": 1}
    for text in (rep.table, rep.markdown_path.read_text()):
        assert ("credit vs known errors (task arith3; model tiny; 2 files, 128 trajectories, 44 failed with the "
                "wrong step located; mean ± 95% t over files)") in text
        assert "| gear     | 0.750 ± 0.635 (n=2) | 2.500 ± 6.353 (n=2) |" in text
        assert "onset precision" in text and "| –" in text  # grpo has no onset
        assert "signals AUROC: entropy 0.650 ± 0.635 (n=2); saliency 0.550 (n=1)" in text


def test_a_store_moved_to_another_folder_keeps_its_credit_table_and_takes_the_report_beside_its_database(tmp_path):
    """A committed store extracted elsewhere (its runs' artifact URIs name the folder it was made in): the report
    reads the children's credit-eval files and writes the parent's report beside the database it was given."""
    import shutil

    made = tmp_path / "made"
    made.mkdir()
    uri, client, pid, ids = _fake_comparison(made, "mv", FINALS)
    client.log_artifact(ids[("gear", 0)], str(_credit_file(tmp_path, "a", CE_A)), "credit_eval")
    client.log_artifact(ids[("gear", 1)], str(_credit_file(tmp_path, "b", CE_B)), "credit_eval")
    here = tmp_path / "elsewhere" / "runs"
    shutil.move(str(made), str(here))
    rep = build_report(f"sqlite:///{here / 'mlflow.db'}", "mv", out_dir=tmp_path / "rep")
    assert rep.credit_eval["runs"] == ["gear-s0", "gear-s1"] and rep.credit_eval["n_files"] == 2
    assert "| gear     | 0.750 ± 0.635 (n=2) |" in rep.markdown_path.read_text()
    assert not made.exists()  # nothing written under the recorded path
    reports = sorted(p.name for p in (here / "mlartifacts").rglob("report/*"))
    assert reports == ["curves.png", "report.json", "report.md"]


def test_moved_artifact_dir_maps_only_a_missing_folder_of_an_mlartifacts_tree(tmp_path):
    from gearlab.trainer.tracking import moved_artifact_dir

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    gone = "file:///nowhere/runs/mlartifacts/compare_x/abc/artifacts"
    assert moved_artifact_dir(uri, gone) == tmp_path / "mlartifacts" / "compare_x" / "abc" / "artifacts"
    (tmp_path / "kept").mkdir()
    assert moved_artifact_dir(uri, (tmp_path / "kept").as_uri()) is None  # the recorded folder exists
    assert moved_artifact_dir(uri, "file:///nowhere/artifacts") is None  # not an mlartifacts tree
    assert moved_artifact_dir("http://127.0.0.1:5000", gone) is None  # a server resolves its own artifacts
    assert moved_artifact_dir(uri, "s3://bucket/mlartifacts/x") is None


def test_credit_eval_table_for_one_file_has_no_interval():
    md, summary = credit_eval_table([CE_A])
    assert "±" not in md and summary["n_files"] == 1
    assert md.splitlines()[0] == ("credit vs known errors (task arith3; model tiny; 1 file, 64 trajectories, "
                                  "20 failed with the wrong step located)")
    assert "| gear     | 0.800 | 2.000       | 0.300        | 0.700           | 0.500        | 20     |" in md
    assert md.splitlines()[-1] == "signals AUROC: entropy 0.600; saliency 0.550"
    assert summary["assigners"]["gear"]["auroc"] == {"mean": 0.8, "half_width": None, "n": 1}
    # no onset anywhere: no onset columns; a non-finite value is left out
    md2, s2 = credit_eval_table([{"assigners": {"grpo": {"auroc": float("nan"), "blame_ratio": 1.0, "prefix_share": 0.5,
                                                         "n": 3}}}])
    assert "onset" not in md2 and "auroc" not in s2["assigners"]["grpo"] and "| grpo     | –" in md2
    assert not math.isnan(s2["assigners"]["grpo"]["blame_ratio"]["mean"])


def test_a_difference_that_rounds_to_zero_has_no_sign():
    """Two methods that end level differ by a float's last bit (the main job: gear − grpo = −1.2e-8): the table
    prints "0.0", not "-0.0"; a real difference keeps its sign."""
    from gearlab.commands.report_text import amount as _amount, fmt as _fmt

    assert _fmt(-1.19e-8, 0.0072, 5, pct=True) == "0.0 ± 0.7 (n=5)"
    assert _fmt(-0.0006, 0.0072, 5, pct=True) == "-0.1 ± 0.7 (n=5)"
    assert _amount(-1.19e-8, True, signed=True) == "+0.0 points" and _amount(-0.0004, True) == "0.0 points"
    assert _amount(-0.0412, False, signed=True) == "-0.0412" and _fmt(-1e-12, None, 3) == "-1e-12 (n=3)"


def test_the_pairing_line_names_seeds_whose_children_sampled_different_first_rollouts(tmp_path):
    """Children of one seed must begin with the same tokens (train/rollout_crc at iteration 0); the report says
    exact, names the seeds where they differ, or says it could not check."""
    from gearlab.commands.report_rows import pairing_line

    _, client, _, ids = _fake_comparison(tmp_path, "pairs", FINALS)
    finished = {k: client.get_run(r) for k, r in ids.items()}
    assert pairing_line(client, finished).startswith("pairing: not checked")
    for (a, s), rid in ids.items():
        client.log_metric(rid, "train/rollout_crc", 1000.0 + s, step=0)
        client.log_metric(rid, "train/rollout_crc", 7.0, step=1)  # later iterations may differ
    assert pairing_line(client, finished).startswith(
        "pairing: exact — for each of 3 seed(s) with several children, their first rollouts are the same tokens")
    client.log_metric(ids[("gear", 1)], "train/rollout_crc", 5.0, step=0)  # a second value at step 0: sorted first
    line = pairing_line(client, finished)
    assert line.startswith("pairing: NOT exact — seed 1: 2 different first rollouts among 3 children"), line
    assert "seed 0" not in line and "seed 2" not in line
