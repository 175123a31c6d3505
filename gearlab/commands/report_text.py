"""The text of ``gearlab report``: numbers with their intervals, the paired table, the ``learning:`` and ``power:``
lines and report.md's preamble. Pure formatting of the rows :mod:`gearlab.commands.report_rows` computes."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from gearlab.commands.report_plot import SMOOTH
from gearlab.commands.report_rows import ALPHA, POWER, TOOL_METRICS


def signless_zero(v: float, spec: str) -> str:
    """``format(v, spec)``, with a value that rounds to zero printed without a sign of its own ("0.0", never "-0.0":
    two methods that end level differ by a float's last bit either way)."""
    out = format(v, spec)
    return format(0.0, spec) if float(out) == 0 else out


def fmt(mean: float, hw: float | None, n: int, pct: bool = False, note: str | None = None) -> str:
    """``mean ± hw (n=…)``; without an interval ``mean (n=…)``, or ``mean (n=…, note)`` saying why it is withheld."""
    if math.isnan(mean):
        return "–"
    f = (lambda v: signless_zero(100 * v, ".1f")) if pct else (lambda v: signless_zero(v, ".3g"))
    if hw is not None:
        return f"{f(mean)} ± {f(hw)} (n={n})"
    return f"{f(mean)} (n={n}, {note})" if note else f"{f(mean)} (n={n})"


def is_percent(metric: str) -> bool:
    """Whether the metric is shown in percent / points (accuracy, avg@k and pass@k: ``eval/avg_at_4``, also typed
    ``eval/avg@4``)."""
    return metric.endswith("accuracy") or "@" in metric or "_at_" in metric


def amount(v: float, pct: bool, signed: bool = False) -> str:
    """A difference in the metric's units: ``4.1 points`` for percent-like metrics (×100), else ``0.0412``."""
    if pct:
        return f"{signless_zero(100 * v, ('+' if signed else '') + '.1f')} points"
    return signless_zero(v, ("+" if signed else "") + ".3g")


def learning_line(rows: list[dict[str, Any]], pct: bool) -> str:
    """``learning: grpo +6.1 ± 3.2 points (n=5, excludes 0); gear …`` — each method's paired change from its start
    with the 95% t half-width, and whether that interval excludes 0 (the method learned, or got worse). Where the
    interval would be no evidence it is withheld and the reason given instead: ``(n=2, n too small)``,
    ``(n=3, no spread, interval undefined)``; no start logged: ``–``. Raw units (``+0.061 ± 0.032``) for metrics not
    in percent."""
    parts = []
    for r in rows:
        lr = r.get("learning") or {}
        m, hw, n = lr.get("mean"), lr.get("half_width"), lr.get("n", 0)
        unit = " points" if pct else ""
        if m is None:
            parts.append(f"{r['assigner']} – (no start logged)")
        elif hw is None:
            parts.append(f"{r['assigner']} {amount(m, pct, signed=True)} (n={n}, {lr.get('note') or 'no interval'})")
        else:
            num, h = amount(m, pct, signed=True).removesuffix(unit), amount(hw, pct).removesuffix(unit)
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
        if p["mde80"] is None:  # no spread: an SD of 0 says nothing about the noise of the next seed
            out.append(head + f"not computable (n={p['n']} paired seeds, no spread: every seed gave the same "
                              f"difference, so the paired SD is 0)")
            continue
        need = p["n_needed"]
        tail = ("" if effect == 0 else f"; detecting {eff} needs " +
                (f"{need} seeds" if need is not None else "more than 10000 seeds"))
        out.append(head + f"paired SD {amount(p['sd'], pct)} (n={p['n']}); smallest difference detectable at "
                   f"{100 * POWER:.0f}% power (two-sided α={ALPHA:g}): {amount(p['mde80'], pct)}" + tail)
    return out


def mismatch_line(m: dict[str, Any]) -> str:
    """One ``WARNING: runs differ in KEY (value: runs; …)`` line of a ``report.version_mismatch`` entry."""
    return f"WARNING: runs differ in {m['key']} (" + "; ".join(
        f"{v}: {', '.join(ls)}" for v, ls in m["values"].items()
    ) + ")"


def paired_table(rows: list[dict[str, Any]], metric: str, baseline: str, target: float | None, pct: bool) -> str:
    """The headline table: per method its final value, start, change from start, paired Δ to ``baseline``, MDE80,
    cost columns and (with a ``target``) the steps, seconds and tokens to reach it."""
    head = ["method", f"final {metric}" + (" (%)" if pct else ""), "start", "change from start",
            f"Δ vs {baseline} (paired)", "MDE80", "s / iter", "wall min", "gen. tokens"]
    if target is not None:
        head += [f"reached {target:g}", "steps to target", "wall s to target", "tokens to target"]
    lines = [head]
    for r in rows:
        d = ("baseline" if r["assigner"] == baseline
             else fmt(r.get("diff", float("nan")), r.get("diff_ci95"), r.get("diff_n", 0), pct, r.get("diff_note")))
        mde = (r.get("paired") or {}).get("mde80")
        mde_s = "–" if mde is None else fmt(mde, None, 0, pct).split(" (")[0]
        line = [r["assigner"], fmt(r["mean"], r["ci95"], r["n"], pct, r.get("ci95_note")),
                fmt(r.get("start", float("nan")), None, 0, pct).split(" (")[0],
                fmt(r.get("change", float("nan")), r.get("change_ci95"), r.get("change_n", 0), pct,
                r.get("change_note")),
                d, mde_s,
                f"{r['s_per_iter']:.2f}", f"{r['wall_min']:.1f}",
                f"{r['tokens']:.0f}" if r["tokens"] == r["tokens"] else "–"]
        if target is not None:
            line += [r["reached"]] + [f"{r[f'to_target_{k}']:.{1 if k == 'wall_s' else 0}f}"
                                      if r[f"to_target_{k}"] == r[f"to_target_{k}"] else "–" for k in (
                                          "steps", "wall_s", "tokens"
                                      )]
        lines.append(line)
    return markdown_table(lines)


def tool_table(rows: list[dict[str, Any]]) -> str:
    """Final greedy tool use per method (mean ± 95% t over seeds): fractions in %, turns as a count."""
    head = ["method"] + [f"{name} (final greedy)" for name in TOOL_METRICS.values()]
    lines = [head]
    for r in rows:
        tu = r.get("tool_use", {})
        lines.append([r["assigner"]] + [fmt(*tu[k], pct=k.endswith("frac")) if k in tu else "–" for k in TOOL_METRICS])
    return markdown_table(lines)


def report_markdown(comparison: str, tracking: str, table: str, rows, missing, metric, baseline, target,
              eval_on_train: bool = False) -> str:
    """report.md: where the numbers come from, how to read them, then ``table`` and the missing runs."""
    if tracking.startswith("sqlite:///"):  # a local file: show it relative to where the report is run from
        try:
            tracking = "sqlite:///" + str(
                Path(tracking[len("sqlite:///"):]).resolve().relative_to(Path.cwd().resolve())
            )
        except ValueError:
            pass
    parts = [f"# Comparison `{comparison}`", "",
             f"Source: MLflow at `{tracking}`, experiment `compare/{comparison}` (this report reads nothing else).", "",
             f"Headline: final `{metric}` of each run ("
             + ("the evaluation after the last iteration, on the TRAINING problems: the task has no separate test "
                "split, so this measures fitting, not generalisation" if eval_on_train
                else "the held-out evaluation after the last iteration") + "). "
             "Mean ± half-width of the two-sided 95% Student-t interval over seeds; n = seeds. "
             f"Δ = paired per-seed difference to `{baseline}` (same seeds, same prompts, same sampling seeds), "
             "same interval on the differences; an interval from fewer than 3 seeds or from values that are all "
             "equal is withheld and the reason shown (\"n too small\", \"no spread, interval undefined\"). MDE80 = the "
             "smallest paired difference the seeds had 80% power to "
             "detect (two-sided paired t-test at 5%, exact noncentral t). s / iter = rollout + signals + update per "
             "iteration.", "",
             "Under the table: `learning:` gives each method's paired change from its start and whether its 95% "
             "interval "
             "excludes 0; each `power:` line the SD of the per-seed paired differences, the MDE80 and the seeds a "
             "stated "
             "difference would need (docs/comparisons.md, \"Reading the power line\"). A difference whose interval "
             "contains 0 is only \"no difference larger than the MDE80 could be seen\". `pairing:` says whether "
             "the children of each seed sampled the same first rollout, as a paired design needs.", "", table, ""]
    if target is not None:
        parts += [f"Steps to target: first iteration where the training accuracy, averaged over a {SMOOTH}-iteration "
                  "window, "
                  f"reaches {target:g}; averaged over the seeds that reached it.", ""]
    parts += ["Learning curves: `curves.png` (training accuracy per iteration, mean over seeds with a 95% t band, "
              "clipped to [0, 1]).", ""]
    parts += (
        ["Missing runs (not in the statistics): " + ", ".join(missing), ""] if missing else ["All runs finished.", ""]
    )
    return "\n".join(parts)


def markdown_table(lines: list[list[Any]]) -> str:
    """A markdown table from rows of cells (the first row is the header), columns padded to their widest cell."""
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(lines[0]))]

    def line(row: list[Any]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |"

    return "\n".join([line(lines[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, lines[1:])])
