"""``gearlab report COMPARISON``: the comparison's table and curves, rebuilt from MLflow alone.

Statistics: per method, the mean over seeds of each run's final value with a two-sided 95%
Student-t interval (mean ± t_{0.975, n−1}·s/√n, s the unbiased std); the
paired difference to the baseline over the seeds both finished, with the same t-interval on the
per-seed differences; the start (the metric's first point, the evaluation before the first iteration, mean over
seeds) and the paired change from it with the same t-interval — does the method learn at all? n is printed
next to every number. An interval is withheld, with its reason printed instead, when it would be no evidence
(:func:`gearlab.core.power.interval_note`): fewer than 3 values ("n too small") or values that are all equal
("no spread, interval undefined" — a zero-width interval is not certainty). Steps to target use the training accuracy
smoothed over a 5-iteration window; a run that never reaches it is reported as such.

Provenance: the finished children's ``versions.*`` tags and ``git_sha`` are compared; a difference is a
WARNING line under the table (and ``version_mismatch`` in report.json). Runs without the tags (made
before gearlab recorded them) count as "unknown", which alone is no mismatch.

Power (:mod:`gearlab.core.power`): per non-baseline method, the SD of the per-seed paired differences, the
smallest true paired difference the seeds had 80% power to detect (two-sided paired t-test at α = 0.05, exact
noncentral t) and the seeds a stated ``effect`` (metric units, default 0.03 = 3 points of an accuracy) would
need. Printed under the table as one ``power:`` line per method, with a ``learning:`` line saying whether each
method's 95% interval of the change from start excludes 0; in report.json as ``learning`` and ``paired`` per row.

The headline metric: the ``metric`` argument, else the parent run's ``primary_metric`` tag, else
``eval/greedy_accuracy``. Children that logged a ``credit_eval/credit_eval.json`` artifact add a "credit vs known
errors" table (:func:`credit_eval_table`).

report.md is also the comparison's parent run's description in MLflow (the ``mlflow.note.content`` tag, cut at a
line boundary past MLflow's 8,000-character tag limit). The headline numbers are also logged on the comparison's
parent run, at step 0: ``<method>/final_mean``,
``<method>/final_ci95``, ``<method>/n``, ``<method>/paired_diff``, ``<method>/paired_ci95``,
``<method>/paired_n``, ``<method>/paired_sd``, ``<method>/mde80``, ``<method>/n_needed``,
``<method>/learning_mean``, ``<method>/learning_ci95``, ``<method>/s_per_iter``, ``<method>/wall_min``
(a re-built report logs them again).
"""
from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import RunStatus
from mlflow.utils.mlflow_tags import MLFLOW_RUN_NOTE
from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

from gearlab.core.metrics import sanitize_metric_key
from gearlab.commands.report_credit import credit_eval_table, credit_evals  # noqa: F401 (credit_eval_table re-exported)
from gearlab.commands.report_plot import CURVE, SMOOTH, _band, _bounds, _plot, _smooth  # noqa: F401 (re-exported)
from gearlab.commands.report_text import (is_percent, learning_line, mismatch_line, paired_table,
                                          power_lines, report_markdown, tool_table)
from gearlab.commands.report_rows import (ALPHA, POWER, TOOL_METRICS, Collected, _history, _num, collect,  # noqa: F401
                                          method_row, pairing_line)
from gearlab.core.power import t_interval
from gearlab.trainer.provenance import TAG_PREFIX
from gearlab.trainer.tracking import moved_artifact_dir

DEFAULT_METRIC = "eval/greedy_accuracy"


@dataclass
class Report:
    table: str
    markdown_path: Path
    plot_path: Path
    rows: list[dict[str, Any]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    version_mismatch: list[dict[str, Any]] = field(default_factory=list)
    credit_eval: dict[str, Any] | None = None


def load_comparison(tracking: str, comparison: str) -> tuple[mlflow.MlflowClient, Any, list[Any], list[Any]]:
    client = mlflow.MlflowClient(tracking)
    exp = client.get_experiment_by_name(f"compare/{comparison}")
    if exp is None:
        raise ValueError(
            f"no comparison named {comparison!r} at {tracking} (no MLflow experiment 'compare/{comparison}')"
        )
    runs = client.search_runs([exp.experiment_id], f"tags.comparison_id = '{comparison}'", max_results=5000)
    parent = next((r for r in runs if r.data.tags.get("gearlab.role") == "parent"), None)
    children = [r for r in runs if "assigner" in r.data.tags and r.data.tags.get("gearlab.role") != "parent"]
    return client, parent, children, runs


def build_report(tracking: str, comparison: str, *, metric: str | None = None, baseline: str = "grpo",
                 target: float | None = None, out_dir: Path | str = "report", log_to_parent: bool = True,
                 effect: float = 0.03, more_curves: list[str] | tuple[str, ...] = ()) -> Report:
    """Rebuild the comparison's table, power and learning lines, plot, report.md and report.json from MLflow.

    ``metric``: the headline metric; None takes the parent run's ``primary_metric`` tag, else
    ``eval/greedy_accuracy``. ``effect``: the paired difference (metric units; 0.03 = 3 points of an accuracy)
    whose needed number of seeds the power line states. ``more_curves``: more per-iteration metrics (e.g.
    ``credit/adv_std``, ``credit/sign_flip_frac``), each plotted across methods like the training accuracy, into
    ``curves_<metric>.png`` (a metric no run logged gets a note instead)."""
    client, parent, children, _ = load_comparison(tracking, comparison)
    metric, metric_source = _primary_metric(parent, metric)
    baseline, order, seeds = _design(parent, children, baseline)
    finished = {(r.data.tags["assigner"], int(r.data.tags["seed"])): r for r in children
                if r.info.status == RunStatus.to_string(RunStatus.FINISHED)}
    seeds = seeds or sorted({s for _, s in finished})
    missing = [f"{a}-s{s} ({_status(children, a, s)})" for a in order for s in seeds if (a, s) not in finished]
    data = collect(client, finished, order, metric, target)
    rows = [method_row(a, data, baseline, effect, target) for a in order]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pct = is_percent(metric)
    labelled = {f"{a}-s{s}": finished[(a, s)] for a in order for s in sorted(s_ for a_, s_ in finished if a_ == a)}
    table, credit, mismatch, unknown, warnings = _tables(client, rows, data, labelled, metric, baseline, target, pct,
                                                         tracking)
    table += "\n\n" + "\n".join([learning_line(rows, pct), *power_lines(rows, baseline, effect, pct),
                                  pairing_line(client, finished)])
    plot = out / "curves.png"
    _plot(data.curves, final_points=data.final, path=plot, metric=metric, baseline=baseline)
    extra_plots, notes = _more_curves(client, finished, order, data.final, more_curves, out, metric, baseline)
    if extra_plots or notes:
        table += "\n\n" + "\n".join(
            ([f"more curves: {', '.join(p.name for p in extra_plots)}"] if extra_plots else []) + notes
        )
    md = out / "report.md"
    on_train = any(r.data.tags.get("eval_split") == "train" for r in finished.values())
    md.write_text(
        report_markdown(comparison, tracking, table, rows, missing, metric, baseline, target, eval_on_train=on_train)
    )
    (out / "report.json").write_text(json.dumps({
        "comparison": comparison, "metric": metric, "primary_metric": metric, "primary_metric_source": metric_source,
        "baseline": baseline, "power_settings": {"power": POWER, "alpha": ALPHA, "effect": effect},
        "rows": rows, "missing": missing, "version_mismatch": mismatch, "versions_unknown": unknown,
        "credit_eval": credit}, indent=2, default=str))
    if log_to_parent and parent is not None:
        _log_report_files(client, tracking, parent, [md, plot, out / "report.json", *extra_plots])
        log_headline(client, parent.info.run_id, rows)
        client.set_tag(parent.info.run_id, MLFLOW_RUN_NOTE, run_description(md.read_text()))
    return Report(table, md, plot, rows, missing, warnings, mismatch, credit)


def _log_report_files(client: mlflow.MlflowClient, tracking: str, parent: Any, files: list[Path]) -> None:
    """The report's files as the parent run's ``report/`` artifacts; in a SQLite store moved from elsewhere, beside
    its database (:func:`moved_artifact_dir`), not under the absolute path recorded where it was made."""
    moved = moved_artifact_dir(tracking, parent.info.artifact_uri)
    for f in files:
        if moved is None:
            client.log_artifact(parent.info.run_id, str(f), "report")
        else:
            (moved / "report").mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, moved / "report" / Path(f).name)


def _primary_metric(parent: Any, metric: str | None) -> tuple[str, str]:
    """(the headline metric as MLflow stores it, where it came from): the argument, else the parent's
    ``primary_metric`` tag, else the default. eval/avg@4 (typed, or an older parent's tag) is eval/avg_at_4."""
    tag_metric = parent.data.tags.get("primary_metric") if parent is not None else None
    if metric:
        return sanitize_metric_key(metric), "argument"
    if tag_metric:
        return sanitize_metric_key(tag_metric), "parent tag primary_metric"
    return sanitize_metric_key(DEFAULT_METRIC), "default"


def _design(parent: Any, children: list[Any], baseline: str | None) -> tuple[str | None, list[str], list[int]]:
    """(baseline, methods in the comparison's order, seeds) from the parent's tags, else from the children."""
    if parent is None:
        return baseline, sorted({r.data.tags["assigner"] for r in children}), []
    baseline = parent.data.tags.get("baseline", baseline) if baseline is None else baseline
    # methods_json: the methods in order (grid-point labels may contain commas); older parents: "assigners"
    order = (json.loads(parent.data.tags["methods_json"]) if "methods_json" in parent.data.tags
             else parent.data.tags.get("assigners", "").split(","))
    seeds = [int(s) for s in parent.data.tags.get("seeds", "").split(",") if s]
    return baseline, [a for a in order if a] or sorted({r.data.tags["assigner"] for r in children}), seeds


def _tables(client: mlflow.MlflowClient, rows: list[dict[str, Any]], data: Collected, labelled: dict[str, Any],
            metric: str, baseline: str, target: float | None, pct: bool, tracking: str | None = None
            ) -> tuple[str, dict[str, Any] | None, list[dict[str, Any]], list[str], list[str]]:
    """The paired table, then (multi-turn) tool use, the credit-eval table and the version warnings — the order the
    console shows at the end of a comparison. Returns (text, credit-eval summary, mismatches, runs without version
    tags, warning lines)."""
    table = paired_table(rows, metric, baseline, target, pct=pct)
    if data.tool_final:
        for row in rows:
            tools = data.tool_final.get(row["assigner"], {})
            row["tool_use"] = {k: t_interval(v) + (len(v),) for k, v in tools.items()}
        table += "\n\n" + tool_table(rows)
    evals = credit_evals(client, labelled, tracking)
    credit = None
    if evals:
        credit_md, credit = credit_eval_table([d for _, d in evals])
        credit["runs"] = [label for label, _ in evals]
        table += "\n\n" + credit_md
    mismatch, unknown = version_mismatch(labelled)
    warnings = [mismatch_line(m) for m in mismatch]
    if unknown:
        warnings.append("note: no version tags on " + ", ".join(unknown) + " (runs made before gearlab recorded "
                        "them): their versions are unknown")
    if warnings:  # the table's footer: printed with it and in report.md
        table += "\n\n" + "\n".join(warnings)
    return table, credit, mismatch, unknown, warnings


def _more_curves(client: mlflow.MlflowClient, finished: dict[tuple[str, int], Any], order: list[str],
                 final: dict[str, dict[int, float]], names: list[str] | tuple[str, ...], out: Path, metric: str,
                 baseline: str) -> tuple[list[Path], list[str]]:
    """One plot per extra per-iteration metric across methods; a note for each that no run logged."""
    plots, notes = [], []
    for name in names:
        key = sanitize_metric_key(name)
        series = {a: {s: [v for _, v, _ in _history(client, finished[(a, s)].info.run_id, key)]
                      for s in sorted(s_ for a_, s_ in finished if a_ == a)} for a in order}
        series = {a: {s: v for s, v in runs.items() if v} for a, runs in series.items()}
        if not any(series.values()):
            notes.append(f"note: no run logged {name!r}; no curve for it")
            continue
        plots.append(out / f"curves_{key.replace('/', '_')}.png")
        _plot(series, final_points=final, path=plots[-1], metric=metric, baseline=baseline, curve=name)
    return plots, notes


def run_description(markdown: str, limit: int = MAX_TAG_VAL_LENGTH) -> str:
    """report.md as the parent run's description (the ``mlflow.note.content`` tag, which the MLflow UI shows as the
    run's markdown description): whole when it fits MLflow's tag limit, else cut at a line boundary with a note
    pointing at the full file (MLflow would otherwise cut it mid-line, silently)."""
    if len(markdown) <= limit:
        return markdown
    tail = "\n\n… (cut to fit MLflow's description limit: the full report is the artifact report/report.md)\n"
    head = markdown[: limit - len(tail)]
    return head[: head.rfind("\n") + 1 or len(head)].rstrip("\n") + tail


def parent_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The headline numbers of each method as MLflow-safe metric names (``<method>/final_mean`` …); a number
    that does not exist (no interval with one seed, no paired difference for the baseline) is left out."""
    out: dict[str, float] = {}
    for r in rows:
        for name, k in (("final_mean", "mean"), ("final_ci95", "ci95"), ("n", "n"), ("paired_diff", "diff"),
                        ("paired_ci95", "diff_ci95"), ("paired_n", "diff_n"), ("paired_sd", ("paired", "sd")),
                        ("mde80", ("paired", "mde80")), ("n_needed", ("paired", "n_needed")),
                        ("learning_mean", ("learning", "mean")), ("learning_ci95", ("learning", "half_width")),
                        ("s_per_iter", "s_per_iter"), ("wall_min", "wall_min")):
            v = (r.get(k[0]) or {}).get(k[1]) if isinstance(k, tuple) else r.get(k)
            if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)):
                out[sanitize_metric_key(f"{r['assigner']}/{name}")] = float(v)
    return out


def log_headline(client: mlflow.MlflowClient, run_id: str, rows: list[dict[str, Any]]) -> dict[str, float]:
    """Log :func:`parent_metrics` on the parent run at step 0 (a re-built report's values are the latest)."""
    import time

    from mlflow.entities import Metric

    metrics = parent_metrics(rows)
    now = int(time.time() * 1000)
    items = [Metric(k, v, now, 0) for k, v in metrics.items()]
    for s in range(0, len(items), 1000):
        client.log_batch(run_id, metrics=items[s: s + 1000])
    return metrics


def version_mismatch(runs: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Compare the ``versions.*`` tags and the git commit of runs ({label: run}). Returns (mismatches, labels of
    runs without any version tag). A mismatch is ``{"key", "values": {value: [labels]}}`` for a key whose known
    values differ; runs lacking the key are listed under "unknown" but never make a mismatch by themselves.
    The git commit is one key, ``git_sha`` (``versions.gearlab`` where recorded, else the ``git_sha`` tag)."""
    def value(tags: dict[str, str], key: str) -> str:
        v = (tags.get(TAG_PREFIX + "gearlab") or tags.get("git_sha")) if key == "git_sha" else tags.get(key)
        return v if v and v != "unknown" else "unknown"

    keys = sorted(
        {k for r in runs.values() for k in r.data.tags if k.startswith(TAG_PREFIX)} - {TAG_PREFIX + "gearlab"}
    )
    out = []
    for key in ["git_sha", *keys]:
        groups: dict[str, list[str]] = {}
        for label, r in runs.items():
            groups.setdefault(value(r.data.tags, key), []).append(label)
        if len(set(groups) - {"unknown"}) > 1:
            out.append(
                {"key": key, "values": {v: groups[v] for v in sorted(groups, key=lambda v: (v == "unknown", v))}}
            )
    unknown = [label for label, r in runs.items() if not any(k.startswith(TAG_PREFIX) for k in r.data.tags)]
    return out, unknown


def _status(children: list[Any], a: str, s: int) -> str:
    for r in children:
        if r.data.tags.get("assigner") == a and r.data.tags.get("seed") == str(s):
            err = r.data.tags.get("error", "").strip().splitlines()
            return r.info.status.lower() + (f": {err[-1][:100]}" if err else "")
    return "not run"


