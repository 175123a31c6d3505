"""``gearlab report COMPARISON``: the comparison's table and curves, rebuilt from MLflow alone.

Statistics: per method, the mean over seeds of each run's final value with a two-sided 95%
Student-t interval (mean ± t_{0.975, n−1}·s/√n, s the unbiased std; no interval when n = 1); the
paired difference to the baseline over the seeds both finished, with the same t-interval on the
per-seed differences; the start (the metric's first point, the evaluation before the first iteration, mean over
seeds) and the paired change from it with the same t-interval — does the method learn at all? n is printed
next to every number. Steps to target use the training accuracy
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

The headline numbers are also logged on the comparison's parent run, at step 0: ``<method>/final_mean``,
``<method>/final_ci95``, ``<method>/n``, ``<method>/paired_diff``, ``<method>/paired_ci95``,
``<method>/paired_n``, ``<method>/paired_sd``, ``<method>/mde80``, ``<method>/n_needed``,
``<method>/learning_mean``, ``<method>/learning_ci95``, ``<method>/s_per_iter``, ``<method>/wall_min``
(a re-built report logs them again).
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import RunStatus

from gearlab.core.metrics import sanitize_metric_key
from gearlab.core.power import mde_paired, paired_sd, seeds_needed
from gearlab.trainer.provenance import TAG_PREFIX

DEFAULT_METRIC = "eval/greedy_accuracy"
CURVE = "train/accuracy"
POWER, ALPHA = 0.8, 0.05  # the power line: detectable at 80% power, two-sided paired t-test at 5%
CREDIT_EVAL_ARTIFACT = "credit_eval/credit_eval.json"
# the credit-eval table's columns: (key in credit_eval.json's "assigners" entries, header)
CREDIT_FIELDS = (("auroc", "AUROC"), ("blame_ratio", "blame ratio"), ("prefix_share", "prefix share"),
                 ("onset_precision", "onset precision"), ("onset_recall", "onset recall"))
SMOOTH = 5
# multi-turn tasks: how the final greedy episodes used their tools (a second table when runs logged them)
TOOL_METRICS = {"eval/greedy_tool_call_frac": "called a tool", "eval/greedy_correct_call_frac": "correct calls",
                "eval/greedy_finish_frac": "finished", "eval/greedy_turns_mean": "turns"}


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


def t_interval(xs: list[float]) -> tuple[float, float | None]:
    """(mean, half-width of the 95% Student-t interval) — half-width None when n < 2."""
    n = len(xs)
    if n == 0:
        return float("nan"), None
    mean = sum(xs) / n
    if n < 2:
        return mean, None
    from scipy.stats import t

    s = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    return mean, float(t.ppf(0.975, n - 1)) * s / math.sqrt(n)


def _fmt(mean: float, hw: float | None, n: int, pct: bool = False) -> str:
    if math.isnan(mean):
        return "–"
    f = (lambda v: f"{100 * v:.1f}") if pct else (lambda v: f"{v:.3g}")
    return f"{f(mean)} ± {f(hw)} (n={n})" if hw is not None else f"{f(mean)} (n={n})"


def _history(client: mlflow.MlflowClient, run_id: str, key: str) -> list[tuple[int, float, int]]:
    h = client.get_metric_history(run_id, sanitize_metric_key(key))
    last: dict[int, Any] = {}
    for m in h:  # a resumed run may log a step twice: keep the latest value
        if m.step not in last or m.timestamp >= last[m.step].timestamp:
            last[m.step] = m
    return [(s, last[s].value, last[s].timestamp) for s in sorted(last)]


def _smooth(vals: list[float], w: int = SMOOTH) -> list[float]:
    return [sum(vals[max(0, i - w + 1): i + 1]) / len(vals[max(0, i - w + 1): i + 1]) for i in range(len(vals))]


def load_comparison(tracking: str, comparison: str) -> tuple[mlflow.MlflowClient, Any, list[Any], list[Any]]:
    client = mlflow.MlflowClient(tracking)
    exp = client.get_experiment_by_name(f"compare/{comparison}")
    if exp is None:
        raise ValueError(f"no comparison named {comparison!r} at {tracking} (no MLflow experiment 'compare/{comparison}')")
    runs = client.search_runs([exp.experiment_id], f"tags.comparison_id = '{comparison}'", max_results=5000)
    parent = next((r for r in runs if r.data.tags.get("gearlab.role") == "parent"), None)
    children = [r for r in runs if "assigner" in r.data.tags and r.data.tags.get("gearlab.role") != "parent"]
    return client, parent, children, runs


def build_report(tracking: str, comparison: str, *, metric: str | None = None, baseline: str = "grpo",
                 target: float | None = None, out_dir: Path | str = "report", log_to_parent: bool = True,
                 effect: float = 0.03) -> Report:
    """Rebuild the comparison's table, power and learning lines, plot, report.md and report.json from MLflow.

    ``metric``: the headline metric; None takes the parent run's ``primary_metric`` tag, else
    ``eval/greedy_accuracy``. ``effect``: the paired difference (metric units; 0.03 = 3 points of an accuracy)
    whose needed number of seeds the power line states."""
    client, parent, children, _ = load_comparison(tracking, comparison)
    tag_metric = parent.data.tags.get("primary_metric") if parent is not None else None
    if metric:
        metric_source = "argument"
    elif tag_metric:
        metric, metric_source = tag_metric, "parent tag primary_metric"
    else:
        metric, metric_source = DEFAULT_METRIC, "default"
    if parent is not None:
        baseline = parent.data.tags.get("baseline", baseline) if baseline is None else baseline
        # methods_json: the methods in order (grid-point labels may contain commas); older parents: "assigners"
        order = (json.loads(parent.data.tags["methods_json"]) if "methods_json" in parent.data.tags
                 else parent.data.tags.get("assigners", "").split(","))
        seeds = [int(s) for s in parent.data.tags.get("seeds", "").split(",") if s]
    else:
        order, seeds = sorted({r.data.tags["assigner"] for r in children}), []
    order = [a for a in order if a] or sorted({r.data.tags["assigner"] for r in children})
    finished = {(r.data.tags["assigner"], int(r.data.tags["seed"])): r for r in children
                if r.info.status == RunStatus.to_string(RunStatus.FINISHED)}
    seeds = seeds or sorted({s for _, s in finished})
    missing = [f"{a}-s{s} ({_status(children, a, s)})" for a in order for s in seeds if (a, s) not in finished]
    key = sanitize_metric_key(metric)
    final: dict[str, dict[int, float]] = {a: {} for a in order}
    start: dict[str, dict[int, float]] = {a: {} for a in order}  # the metric before training (its first point)
    curves: dict[str, dict[int, list[float]]] = {a: {} for a in order}
    cost: dict[str, list[dict[str, float]]] = {a: [] for a in order}
    reach: dict[str, list[dict[str, float] | None]] = {a: [] for a in order}
    tool_final: dict[str, dict[str, list[float]]] = {}
    for (a, s), r in finished.items():
        if a not in final:
            continue
        hist = _history(client, r.info.run_id, key)
        if hist:
            final[a][s] = hist[-1][1]
            if len(hist) > 1 and hist[0][0] == 0:
                start[a][s] = hist[0][1]
        for k in TOOL_METRICS:
            h = _history(client, r.info.run_id, k)
            if h:
                tool_final.setdefault(a, {}).setdefault(k, []).append(h[-1][1])
        acc = _history(client, r.info.run_id, CURVE)
        curves[a][s] = [v for _, v, _ in acc]
        it_time = [sum(v) for v in zip(*[[x for _, x, _ in _history(client, r.info.run_id, f"time/{p}")]
                                          for p in ("rollout_s", "signals_credit_s", "update_s")])]
        toks = _history(client, r.info.run_id, "train/generated_tokens_total")
        cost[a].append({"s_per_iter": sum(it_time) / max(1, len(it_time)),
                        "wall_min": ((r.info.end_time or 0) - r.info.start_time) / 60000,
                        "tokens": toks[-1][1] if toks else float("nan")})
        if target is not None and acc:
            sm = _smooth([v for _, v, _ in acc])
            hit = next((i for i, v in enumerate(sm) if v >= target), None)
            tok_at = {st: v for st, v, _ in toks}
            reach[a].append(None if hit is None else {
                "steps": acc[hit][0] + 1, "wall_s": (acc[hit][2] - acc[0][2]) / 1000, "tokens": tok_at.get(acc[hit][0], float("nan"))})
    rows = []
    for a in order:
        vals = [final[a][s] for s in sorted(final[a])]
        mean, hw = t_interval(vals)
        row: dict[str, Any] = {"assigner": a, "n": len(vals), "mean": mean, "ci95": hw}
        # where the seeds started (the evaluation before the first iteration) and the paired change since
        learned = sorted(set(final[a]) & set(start[a]))
        sm, _ = t_interval([start[a][s] for s in learned])
        cm, chw = t_interval([final[a][s] - start[a][s] for s in learned])
        row.update(start=sm, change=cm, change_ci95=chw, change_n=len(learned))
        row["learning"] = {"mean": _num(cm), "half_width": chw, "n": len(learned)}
        if a != baseline:
            common = sorted(set(final[a]) & set(final.get(baseline, {})))
            diffs = [final[a][s] - final[baseline][s] for s in common]
            dm, dhw = t_interval(diffs)
            row.update(diff=dm, diff_ci95=dhw, diff_n=len(diffs))
            sd = paired_sd(diffs)
            row["paired"] = {"diff": _num(dm), "half_width": dhw, "sd": _num(sd),
                             "mde80": _num(mde_paired(sd, len(diffs), power=POWER, alpha=ALPHA)),
                             "n_needed": seeds_needed(effect, sd, power=POWER, alpha=ALPHA), "n": len(diffs)}
        c = cost[a]
        row.update({k: (sum(x[k] for x in c) / len(c) if c else float("nan")) for k in ("s_per_iter", "wall_min", "tokens")})
        if target is not None:
            hits = [x for x in reach[a] if x is not None]
            row["reached"] = f"{len(hits)}/{len(reach[a])}"
            for k in ("steps", "wall_s", "tokens"):
                row[f"to_target_{k}"] = sum(h[k] for h in hits) / len(hits) if hits else float("nan")
        rows.append(row)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pct = _pct(metric)
    # order: the paired table, then (multi-turn) tool use, the credit-eval table, warnings, and last the
    # learning and power lines — what the console shows at the end of a comparison
    table = _table(rows, metric, baseline, target, pct=pct)
    if tool_final:
        for row in rows:
            row["tool_use"] = {k: t_interval(v) + (len(v),) for k, v in tool_final.get(row["assigner"], {}).items()}
        table += "\n\n" + _tool_table(rows)
    labelled = {f"{a}-s{s}": finished[(a, s)] for a in order for s in sorted(s_ for a_, s_ in finished if a_ == a)}
    evals = _credit_evals(client, labelled)
    credit = None
    if evals:
        credit_md, credit = credit_eval_table([d for _, d in evals])
        credit["runs"] = [label for label, _ in evals]
        table += "\n\n" + credit_md
    mismatch, unknown = version_mismatch(labelled)
    warnings = [_mismatch_line(m) for m in mismatch]
    if unknown:
        warnings.append("note: no version tags on " + ", ".join(unknown) + " (runs made before gearlab recorded "
                        "them): their versions are unknown")
    if warnings:  # the table's footer: printed with it and in report.md
        table += "\n\n" + "\n".join(warnings)
    table += "\n\n" + "\n".join([learning_line(rows, pct), *power_lines(rows, baseline, effect, pct)])
    plot = out / "curves.png"
    _plot(curves, final_points={a: final[a] for a in order}, path=plot, metric=metric, baseline=baseline)
    md = out / "report.md"
    md.write_text(_markdown(comparison, tracking, table, rows, missing, metric, baseline, target))
    (out / "report.json").write_text(json.dumps({
        "comparison": comparison, "metric": metric, "primary_metric": metric, "primary_metric_source": metric_source,
        "baseline": baseline, "power_settings": {"power": POWER, "alpha": ALPHA, "effect": effect},
        "rows": rows, "missing": missing, "version_mismatch": mismatch, "versions_unknown": unknown,
        "credit_eval": credit}, indent=2, default=str))
    if log_to_parent and parent is not None:
        for f in (md, plot, out / "report.json"):
            client.log_artifact(parent.info.run_id, str(f), "report")
        log_headline(client, parent.info.run_id, rows)
    return Report(table, md, plot, rows, missing, warnings, mismatch, credit)


def _num(v: float | None) -> float | None:
    """A number for report.json's nested records: NaN (not computable) becomes None (JSON null)."""
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


def _pct(metric: str) -> bool:
    """Whether the metric is shown in percent / points (accuracy and ``@`` metrics)."""
    return metric.endswith("accuracy") or "@" in metric


def _amount(v: float, pct: bool, signed: bool = False) -> str:
    """A difference in the metric's units: ``4.1 points`` for percent-like metrics (×100), else ``0.0412``."""
    if pct:
        return f"{100 * v:{'+' if signed else ''}.1f} points"
    return f"{v:{'+' if signed else ''}.3g}"


def learning_line(rows: list[dict[str, Any]], pct: bool) -> str:
    """``learning: grpo +6.1 ± 3.2 points (n=5, excludes 0); gear …`` — each method's paired change from its start
    with the 95% t half-width, and whether that interval excludes 0 (the method learned, or got worse). One seed:
    ``(n=1, no interval)``; no start logged: ``–``. Raw units (``+0.061 ± 0.032``) for metrics not in percent."""
    parts = []
    for r in rows:
        lr = r.get("learning") or {}
        m, hw, n = lr.get("mean"), lr.get("half_width"), lr.get("n", 0)
        unit = " points" if pct else ""
        if m is None:
            parts.append(f"{r['assigner']} – (no start logged)")
        elif hw is None:
            parts.append(f"{r['assigner']} {_amount(m, pct, signed=True)} (n={n}, no interval)")
        else:
            num, h = _amount(m, pct, signed=True).removesuffix(unit), _amount(hw, pct).removesuffix(unit)
            parts.append(f"{r['assigner']} {num} ± {h}{unit} (n={n}, {'excludes 0' if abs(m) > hw else 'includes 0'})")
    return "learning: " + "; ".join(parts)


def power_lines(rows: list[dict[str, Any]], baseline: str, effect: float, pct: bool) -> list[str]:
    """One line per non-baseline method: ``power: gear vs grpo: paired SD 4.1 points (n=3); smallest difference
    detectable at 80% power (two-sided α=0.05): 12.3 points; detecting 3 points needs 23 seeds``."""
    eff = f"{100 * effect:g} points" if pct else f"{effect:g}"
    out = []
    for r in rows:
        p = r.get("paired")
        if p is None:
            continue
        head = f"power: {r['assigner']} vs {baseline}: "
        if p["sd"] is None:
            out.append(head + f"not computable (n={p['n']} paired seeds; the paired SD needs at least 2)")
            continue
        need = p["n_needed"]
        tail = ("" if effect == 0 else f"; detecting {eff} needs " +
                (f"{need} seeds" if need is not None else "more than 10000 seeds"))
        out.append(head + f"paired SD {_amount(p['sd'], pct)} (n={p['n']}); smallest difference detectable at "
                   f"{100 * POWER:.0f}% power (two-sided α={ALPHA:g}): {_amount(p['mde80'], pct)}" + tail)
    return out


def _credit_evals(client: mlflow.MlflowClient, runs: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The ``credit_eval/credit_eval.json`` artifacts of the runs ({label: run}) that have one, as (label, dict);
    a run without it (or with an unreadable one) is skipped."""
    out = []
    folder, _, name = CREDIT_EVAL_ARTIFACT.rpartition("/")
    with tempfile.TemporaryDirectory() as tmp:
        for label, r in runs.items():
            try:
                if not any(a.path == CREDIT_EVAL_ARTIFACT for a in client.list_artifacts(r.info.run_id, folder)):
                    continue
                dst = os.path.join(tmp, label)
                os.makedirs(dst, exist_ok=True)
                data = json.loads(Path(client.download_artifacts(r.info.run_id, CREDIT_EVAL_ARTIFACT, dst)).read_text())
            except Exception:  # noqa: BLE001 - a missing or broken artifact only leaves the table out
                continue
            if isinstance(data, dict) and isinstance(data.get("assigners"), dict):
                out.append((label, data))
    return out


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _stat(vals: list[float]) -> dict[str, Any]:
    m, hw = t_interval(vals)
    return {"mean": _num(m), "half_width": hw, "n": len(vals)}


def credit_eval_table(evals: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The "credit vs known errors" table from one or more ``credit_eval.json`` dicts (one per run).

    Rows: the scored assigner names (keys of ``"assigners"``, in order of first appearance); columns: AUROC,
    blame ratio, prefix share and, when any file has them, onset precision / recall — each the mean over the
    files that have a finite value, with the 95% t half-width and n when there are several files (a single
    file gives its values, no interval). A line under the table gives the signals' AUROC the same way.
    Returns (markdown text, summary) with summary ``{"n_files", "tasks", "models", "n_trajectories",
    "n_failed_located", "assigners": {name: {field: {"mean", "half_width", "n"}, "n_files", "n_scored"}},
    "signals": {signal: {"auroc": {"mean", "half_width", "n"}}}}`` (absent fields are left out)."""
    k = len(evals)
    names = list(dict.fromkeys(a for d in evals for a in (d.get("assigners") or {})))
    sigs = list(dict.fromkeys(s for d in evals for s in (d.get("signals") or {})))
    fields = list(CREDIT_FIELDS[:3]) + [  # the onset columns only when some file scored a segmenting method
        (f, h) for f, h in CREDIT_FIELDS[3:]
        if any(_finite(((d.get("assigners") or {}).get(a) or {}).get(f)) for d in evals for a in names)]

    def total(key: str) -> int | None:
        vals = [d[key] for d in evals if _finite(d.get(key))]
        return int(sum(vals)) if vals else None

    summary: dict[str, Any] = {
        "n_files": k, "tasks": sorted({str(d["task"]) for d in evals if d.get("task") is not None}),
        "models": sorted({str(d["model"]) for d in evals if d.get("model") is not None}),
        "n_trajectories": total("n_trajectories"), "n_failed_located": total("n_failed_located"),
        "assigners": {}, "signals": {}}

    def cell(st: dict[str, Any] | None) -> str:
        if st is None or st["mean"] is None:
            return "–"
        if k == 1:
            return f"{st['mean']:.3f}"
        return (f"{st['mean']:.3f} ± {st['half_width']:.3f} (n={st['n']})" if st["half_width"] is not None
                else f"{st['mean']:.3f} (n={st['n']})")

    lines = [["assigner", *[h for _, h in fields], "scored"]]
    for a in names:
        entries = [d["assigners"][a] for d in evals if isinstance((d.get("assigners") or {}).get(a), dict)]
        rec: dict[str, Any] = {}
        for f, _ in CREDIT_FIELDS:
            vals = [float(e[f]) for e in entries if _finite(e.get(f))]
            if vals:
                rec[f] = _stat(vals)
        ns = [e["n"] for e in entries if _finite(e.get("n"))]
        rec["n_files"], rec["n_scored"] = len(entries), (int(sum(ns)) if ns else None)
        summary["assigners"][a] = rec
        lines.append([a, *[cell(rec.get(f)) for f, _ in fields], "–" if rec["n_scored"] is None else str(rec["n_scored"])])
    for s in sigs:
        vals = [float(d["signals"][s]["auroc"]) for d in evals
                if isinstance((d.get("signals") or {}).get(s), dict) and _finite(d["signals"][s].get("auroc"))]
        summary["signals"][s] = {"auroc": _stat(vals)} if vals else {}
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(lines[0]))]
    fmt = lambda row: "| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |"  # noqa: E731
    ctx = []
    if summary["tasks"]:
        ctx.append("task " + ", ".join(summary["tasks"]))
    if summary["models"]:
        ctx.append("model " + ", ".join(summary["models"]))
    count = f"{k} file{'s' if k != 1 else ''}"
    if summary["n_trajectories"] is not None:
        count += f", {summary['n_trajectories']} trajectories"
    if summary["n_failed_located"] is not None:
        count += f", {summary['n_failed_located']} failed with the wrong step located"
    ctx.append(count)
    head = "credit vs known errors (" + "; ".join(ctx) + ("" if k == 1 else "; mean ± 95% t over files") + ")"
    # blank lines around the table: in Markdown a text line right after a table's rows would join the table
    out = [head, "", fmt(lines[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, lines[1:])]
    if sigs:
        out += [""]
        out.append("signals AUROC: " + "; ".join(f"{s} {cell(summary['signals'][s].get('auroc'))}" for s in sigs))
    return "\n".join(out), summary


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

    keys = sorted({k for r in runs.values() for k in r.data.tags if k.startswith(TAG_PREFIX)} - {TAG_PREFIX + "gearlab"})
    out = []
    for key in ["git_sha", *keys]:
        groups: dict[str, list[str]] = {}
        for label, r in runs.items():
            groups.setdefault(value(r.data.tags, key), []).append(label)
        if len(set(groups) - {"unknown"}) > 1:
            out.append({"key": key, "values": {v: groups[v] for v in sorted(groups, key=lambda v: (v == "unknown", v))}})
    unknown = [label for label, r in runs.items() if not any(k.startswith(TAG_PREFIX) for k in r.data.tags)]
    return out, unknown


def _mismatch_line(m: dict[str, Any]) -> str:
    return f"WARNING: runs differ in {m['key']} (" + "; ".join(f"{v}: {', '.join(ls)}" for v, ls in m["values"].items()) + ")"


def _status(children: list[Any], a: str, s: int) -> str:
    for r in children:
        if r.data.tags.get("assigner") == a and r.data.tags.get("seed") == str(s):
            err = r.data.tags.get("error", "").strip().splitlines()
            return r.info.status.lower() + (f": {err[-1][:100]}" if err else "")
    return "not run"


def _table(rows: list[dict[str, Any]], metric: str, baseline: str, target: float | None, pct: bool) -> str:
    head = ["method", f"final {metric}" + (" (%)" if pct else ""), "start", "change from start",
            f"Δ vs {baseline} (paired)", "MDE80", "s / iter", "wall min", "gen. tokens"]
    if target is not None:
        head += [f"reached {target:g}", "steps to target", "wall s to target", "tokens to target"]
    lines = [head]
    for r in rows:
        d = "baseline" if r["assigner"] == baseline else _fmt(r.get("diff", float("nan")), r.get("diff_ci95"), r.get("diff_n", 0), pct)
        mde = (r.get("paired") or {}).get("mde80")
        mde_s = "–" if mde is None else _fmt(mde, None, 0, pct).split(" (")[0]
        line = [r["assigner"], _fmt(r["mean"], r["ci95"], r["n"], pct), _fmt(r.get("start", float("nan")), None, 0, pct).split(" (")[0],
                _fmt(r.get("change", float("nan")), r.get("change_ci95"), r.get("change_n", 0), pct), d, mde_s,
                f"{r['s_per_iter']:.2f}", f"{r['wall_min']:.1f}",
                f"{r['tokens']:.0f}" if r["tokens"] == r["tokens"] else "–"]
        if target is not None:
            line += [r["reached"]] + [f"{r[f'to_target_{k}']:.{1 if k == 'wall_s' else 0}f}"
                                      if r[f"to_target_{k}"] == r[f"to_target_{k}"] else "–" for k in ("steps", "wall_s", "tokens")]
        lines.append(line)
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    fmt = lambda row: "| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |"  # noqa: E731
    return "\n".join([fmt(lines[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, lines[1:])])


def _tool_table(rows: list[dict[str, Any]]) -> str:
    """Final greedy tool use per method (mean ± 95% t over seeds): fractions in %, turns as a count."""
    head = ["method"] + [f"{name} (final greedy)" for name in TOOL_METRICS.values()]
    lines = [head]
    for r in rows:
        tu = r.get("tool_use", {})
        lines.append([r["assigner"]] + [_fmt(*tu[k], pct=k.endswith("frac")) if k in tu else "–" for k in TOOL_METRICS])
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    fmt = lambda row: "| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |"  # noqa: E731
    return "\n".join([fmt(lines[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, lines[1:])])


def _markdown(comparison: str, tracking: str, table: str, rows, missing, metric, baseline, target) -> str:
    if tracking.startswith("sqlite:///"):  # a local file: show it relative to where the report is run from
        try:
            tracking = "sqlite:///" + str(Path(tracking[len("sqlite:///"):]).resolve().relative_to(Path.cwd().resolve()))
        except ValueError:
            pass
    parts = [f"# Comparison `{comparison}`", "",
             f"Source: MLflow at `{tracking}`, experiment `compare/{comparison}` (this report reads nothing else).", "",
             f"Headline: final `{metric}` of each run (the held-out evaluation after the last iteration). "
             "Mean ± half-width of the two-sided 95% Student-t interval over seeds; n = seeds. "
             f"Δ = paired per-seed difference to `{baseline}` (same seeds, same prompts, same sampling seeds), "
             "same interval on the differences. MDE80 = the smallest paired difference the seeds had 80% power to "
             "detect (two-sided paired t-test at 5%, exact noncentral t). s / iter = rollout + signals + update per "
             "iteration.", "",
             "Under the table: `learning:` gives each method's paired change from its start and whether its 95% interval "
             "excludes 0; each `power:` line the SD of the per-seed paired differences, the MDE80 and the seeds a stated "
             "difference would need (docs/comparisons.md, \"Reading the power line\"). A difference whose interval "
             "contains 0 is only \"no difference larger than the MDE80 could be seen\".", "", table, ""]
    if target is not None:
        parts += [f"Steps to target: first iteration where the training accuracy, averaged over a {SMOOTH}-iteration window, "
                  f"reaches {target:g}; averaged over the seeds that reached it.", ""]
    parts += ["Learning curves: `curves.png` (training accuracy per iteration, mean over seeds with a 95% t band, "
              "clipped to [0, 1]).", ""]
    parts += (["Missing runs (not in the statistics): " + ", ".join(missing), ""] if missing else ["All runs finished.", ""])
    return "\n".join(parts)


def _bounds(metric: str, values: list[float] | tuple[float, ...] = ()) -> tuple[float, float] | None:
    """The range a metric's values can take, for clipping its bands; None when unbounded.

    Rule: a metric is accuracy-like, a fraction in [0, 1], when its name contains "accuracy", "avg@" or
    "pass@" (also as MLflow spells them, avg_at_ / pass_at_), or contains "reward" and every observed value
    lies in [0, 1] (the 0/1 correctness rewards; a shaped reward outside [0, 1] stays unclipped). A mean ± t
    band past [0, 1] only shows the normal approximation failing near 0 or 1, so it is clipped there."""
    name = metric.lower()
    if any(s in name for s in ("accuracy", "avg@", "pass@", "avg_at_", "pass_at_")):
        return 0.0, 1.0
    if "reward" in name and values and all(0.0 <= v <= 1.0 for v in values):
        return 0.0, 1.0
    return None


def _band(series: list[list[float]], bounds: tuple[float, float] | None = None) -> tuple[list[float], list[float], list[float]]:
    """(mean, lower, upper) over the series at each step (95% t band), the band clipped to ``bounds``."""
    L = min(len(r) for r in series)
    stats = [t_interval([r[t] for r in series]) for t in range(L)]
    mean = [m for m, _ in stats]
    hw = [h or 0.0 for _, h in stats]
    lo, hi = [m - h for m, h in zip(mean, hw)], [m + h for m, h in zip(mean, hw)]
    if bounds is not None:
        lo = [min(max(v, bounds[0]), bounds[1]) for v in lo]
        hi = [min(max(v, bounds[0]), bounds[1]) for v in hi]
    return mean, lo, hi


def _plot(curves: dict[str, dict[int, list[float]]], final_points: dict[str, dict[int, float]], path: Path, metric: str,
          baseline: str) -> None:
    """Left: training accuracy (mean over seeds, 95% t band). Middle: the paired per-seed difference to the
    baseline (the same prompts make this far less noisy). Right: final metric per seed and its mean ± 95% t."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, axd, ax2) = plt.subplots(1, 3, figsize=(16, 4.2), gridspec_kw={"width_ratios": [3, 3, 1.3]})
    base = {s: _smooth(v) for s, v in curves.get(baseline, {}).items()}
    b = _bounds(CURVE, [v for runs in curves.values() for r in runs.values() for v in r])
    diff_b = (b[0] - b[1], b[1] - b[0]) if b else None  # a difference of two values in [0, 1] lies in [-1, 1]
    fb = _bounds(metric, [v for pts in final_points.values() for v in pts.values()])
    for i, (a, runs) in enumerate(curves.items()):
        color = f"C{i}"
        if runs:
            mean, lo, hi = _band([_smooth(r) for r in runs.values()], b)
            ax.plot(range(len(mean)), mean, color=color, label=f"{a} (n={len(runs)})")
            ax.fill_between(range(len(mean)), lo, hi, color=color, alpha=0.15)
            common = sorted(set(runs) & set(base))
            if a != baseline and common:
                diffs = [[x - y for x, y in zip(_smooth(runs[s]), base[s])] for s in common]
                mean, lo, hi = _band(diffs, diff_b)
                axd.plot(range(len(mean)), mean, color=color, label=f"{a} − {baseline} (n={len(common)})")
                axd.fill_between(range(len(mean)), lo, hi, color=color, alpha=0.15)
        pts = list(final_points.get(a, {}).values())
        ax2.scatter([i] * len(pts), pts, color=color, s=14)
        if pts:
            m, h = t_interval(pts)
            down, up = h or 0.0, h or 0.0
            if fb is not None:
                down, up = max(0.0, min(down, m - fb[0])), max(0.0, min(up, fb[1] - m))
            ax2.errorbar([i + 0.2], [m], yerr=[[down], [up]], fmt="o", color=color, capsize=3)
    ax.set_title(f"training accuracy ({SMOOTH}-iteration mean)\n(line: mean over seeds; band: 95% t)", fontsize=8)
    axd.set_title(f"paired difference to {baseline}, per seed\n(line: mean over seeds; band: 95% t)", fontsize=8)
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"training accuracy ({SMOOTH}-iteration mean)")
    ax.legend(fontsize=8)
    axd.axhline(0, color="k", lw=0.8)
    axd.set_xlabel("iteration")
    axd.set_ylabel("paired difference of training accuracy")
    axd.legend(fontsize=8)
    for a_ in (ax, axd, ax2):
        a_.grid(alpha=0.3)
    ax2.set_xticks(range(len(curves)), list(curves), rotation=45, fontsize=8)
    ax2.set_title(f"final {metric}\n(dots: seeds; bar: mean ± 95% t)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
