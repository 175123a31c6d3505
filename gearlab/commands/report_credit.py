"""The report's "credit vs known errors" table: the ``credit_eval/credit_eval.json`` artifacts of a comparison's
children (``gearlab credit-eval`` on each final model), averaged over the files with a 95% t interval."""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import mlflow

from gearlab.core.power import t_interval
from gearlab.trainer.tracking import moved_artifact_dir

CREDIT_EVAL_ARTIFACT = "credit_eval/credit_eval.json"
# the table's columns: (key in credit_eval.json's "assigners" entries, header)
CREDIT_FIELDS = (("auroc", "AUROC"), ("blame_ratio", "blame ratio"), ("prefix_share", "prefix share"),
                 ("onset_precision", "onset precision"), ("onset_recall", "onset recall"))


def _num(v: float | None) -> float | None:
    """NaN (not computable) becomes None (JSON null)."""
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


def credit_evals(client: mlflow.MlflowClient, runs: dict[str, Any], tracking: str | None = None
                 ) -> list[tuple[str, dict[str, Any]]]:
    """The ``credit_eval/credit_eval.json`` artifacts of the runs ({label: run}) that have one, as (label, dict);
    a run without it (or with an unreadable one) is skipped. ``tracking``: the store's URI, so that a SQLite store
    moved from another folder or machine is read beside its database (:func:`moved_artifact_dir`)."""
    out = []
    folder, _, name = CREDIT_EVAL_ARTIFACT.rpartition("/")
    with tempfile.TemporaryDirectory() as tmp:
        for label, r in runs.items():
            try:
                moved = moved_artifact_dir(tracking, r.info.artifact_uri) if tracking else None
                if moved is not None:
                    path = moved / CREDIT_EVAL_ARTIFACT
                    if not path.is_file():
                        continue
                else:
                    if not any(a.path == CREDIT_EVAL_ARTIFACT for a in client.list_artifacts(r.info.run_id, folder)):
                        continue
                    dst = os.path.join(tmp, label)
                    os.makedirs(dst, exist_ok=True)
                    path = Path(client.download_artifacts(r.info.run_id, CREDIT_EVAL_ARTIFACT, dst))
                data = json.loads(path.read_text())
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
        lines.append(
            [a, *[cell(rec.get(f)) for f, _ in fields], "–" if rec["n_scored"] is None else str(rec["n_scored"])]
        )
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
