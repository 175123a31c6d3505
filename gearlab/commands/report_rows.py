"""What ``gearlab report`` reads from each finished child (``collect``) and the statistics of one method's row
(``method_row``): the final value's interval over seeds, the paired change from the start, the paired difference
to the baseline with its power, the cost and, with a target, when it was reached. The conventions are
``gearlab.commands.report``'s module docstring's."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import mlflow

from gearlab.commands.report_plot import CURVE, _smooth
from gearlab.core.power import mde_paired, paired_sd, reported_interval, seeds_needed, t_interval

POWER, ALPHA = 0.8, 0.05  # the power line: detectable at 80% power, two-sided paired t-test at 5%
# multi-turn tasks: how the final greedy episodes used their tools (a second table when runs logged them)
TOOL_METRICS = {"eval/greedy_tool_call_frac": "called a tool", "eval/greedy_correct_call_frac": "correct calls",
                "eval/greedy_finish_frac": "finished", "eval/greedy_turns_mean": "turns"}


def _history(client: mlflow.MlflowClient, run_id: str, key: str) -> list[tuple[int, float, int]]:
    """(step, value, timestamp ms) of every point of ``key``, by step."""
    return sorted((m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, key))


def _num(v: float | None) -> float | None:
    """A JSON-friendly number: None for a missing or non-finite value."""
    return None if v is None or not math.isfinite(v) else float(v)


@dataclass
class Collected:
    """Per method, per seed: the metric's final and first (start) value, the training-accuracy curve, the cost, when
    the target was reached; per method, the final tool-use values (multi-turn)."""
    final: dict[str, dict[int, float]]
    start: dict[str, dict[int, float]]
    curves: dict[str, dict[int, list[float]]]
    cost: dict[str, list[dict[str, float]]]
    reach: dict[str, list[dict[str, float] | None]]
    tool_final: dict[str, dict[str, list[float]]] = field(default_factory=dict)


def collect(client: mlflow.MlflowClient, finished: dict[tuple[str, int], Any], order: list[str], metric: str,
            target: float | None) -> Collected:
    """Read what the report needs from every finished child (``finished``: (method, seed) → MLflow run) of the
    methods in ``order``. ``metric``: the headline metric as stored (sanitised)."""
    c = Collected({a: {} for a in order}, {a: {} for a in order}, {a: {} for a in order}, {a: [] for a in order},
                  {a: [] for a in order})
    for (a, s), r in finished.items():
        if a not in c.final:
            continue
        rid = r.info.run_id
        hist = _history(client, rid, metric)
        if hist:
            c.final[a][s] = hist[-1][1]
            if len(hist) > 1 and hist[0][0] == 0:  # the evaluation before the first iteration
                c.start[a][s] = hist[0][1]
        for k in TOOL_METRICS:
            h = _history(client, rid, k)
            if h:
                c.tool_final.setdefault(a, {}).setdefault(k, []).append(h[-1][1])
        acc = _history(client, rid, CURVE)
        c.curves[a][s] = [v for _, v, _ in acc]
        it_time = [sum(v) for v in zip(*[[x for _, x, _ in _history(client, rid, f"time/{p}")]
                                          for p in ("rollout_s", "signals_credit_s", "update_s")])]
        toks = _history(client, rid, "train/generated_tokens_total")
        c.cost[a].append({"s_per_iter": sum(it_time) / max(1, len(it_time)),
                          "wall_min": ((r.info.end_time or 0) - r.info.start_time) / 60000,
                          "tokens": toks[-1][1] if toks else float("nan")})
        if target is not None and acc:
            sm = _smooth([v for _, v, _ in acc])
            hit = next((i for i, v in enumerate(sm) if v >= target), None)
            tok_at = {st: v for st, v, _ in toks}
            c.reach[a].append(None if hit is None else {
                "steps": acc[hit][0] + 1, "wall_s": (acc[hit][2] - acc[0][2]) / 1000,
                "tokens": tok_at.get(acc[hit][0], float("nan"))})
    return c


def method_row(a: str, c: Collected, baseline: str, effect: float, target: float | None) -> dict[str, Any]:
    """One method's row: n, mean and 95% interval of the final value; start, paired change from it (``learning``);
    against the baseline (other methods), the paired difference, its SD, MDE80 and the seeds ``effect`` would need
    (``paired``); mean cost; with a target, how many seeds reached it and when."""
    vals = [c.final[a][s] for s in sorted(c.final[a])]
    mean, hw, note = reported_interval(vals)
    row: dict[str, Any] = {"assigner": a, "n": len(vals), "mean": mean, "ci95": hw, "ci95_note": note}
    # where the seeds started (the evaluation before the first iteration) and the paired change since
    learned = sorted(set(c.final[a]) & set(c.start[a]))
    sm, _ = t_interval([c.start[a][s] for s in learned])
    cm, chw, cnote = reported_interval([c.final[a][s] - c.start[a][s] for s in learned])
    row.update(start=sm, change=cm, change_ci95=chw, change_n=len(learned), change_note=cnote)
    row["learning"] = {"mean": _num(cm), "half_width": chw, "n": len(learned), "note": cnote}
    if a != baseline:
        common = sorted(set(c.final[a]) & set(c.final.get(baseline, {})))
        diffs = [c.final[a][s] - c.final[baseline][s] for s in common]
        dm, dhw, dnote = reported_interval(diffs)
        row.update(diff=dm, diff_ci95=dhw, diff_n=len(diffs), diff_note=dnote)
        sd = paired_sd(diffs)
        # every seed gave the same difference: an SD of 0 would promise any effect detectable with 2 seeds
        flat = dnote is not None and dnote.startswith("no spread")
        row["paired"] = {"diff": _num(dm), "half_width": dhw, "sd": _num(sd),
                         "mde80": None if flat else _num(mde_paired(sd, len(diffs), power=POWER, alpha=ALPHA)),
                         "n_needed": None if flat else seeds_needed(effect, sd, power=POWER, alpha=ALPHA),
                         "n": len(diffs), "note": dnote}
    cost = c.cost[a]
    row.update({k: (sum(x[k] for x in cost) / len(cost) if cost else float("nan"))
                for k in ("s_per_iter", "wall_min", "tokens")})
    if target is not None:
        hits = [x for x in c.reach[a] if x is not None]
        row["reached"] = f"{len(hits)}/{len(c.reach[a])}"
        for k in ("steps", "wall_s", "tokens"):
            row[f"to_target_{k}"] = sum(h[k] for h in hits) / len(hits) if hits else float("nan")
    return row


def pairing_line(client: mlflow.MlflowClient, finished: dict[tuple[str, int], Any]) -> str:
    """Whether the design was paired where it must be: the children of one seed start from the same weights with
    the same prompts and sampling seeds, so their first rollouts (``train/rollout_crc`` at iteration 0) must be the
    same tokens. ``pairing: exact — …`` / ``pairing: NOT exact — seed 0: 3 different first rollouts among 3
    children …`` / ``pairing: not checked …`` (runs that logged no fingerprint)."""
    first: dict[int, list[float]] = {}
    unchecked = 0
    for (_, s), r in sorted(finished.items()):
        h = _history(client, r.info.run_id, "train/rollout_crc")
        if h and h[0][0] == 0:
            first.setdefault(s, []).append(h[0][1])
        else:
            unchecked += 1
    if not first:
        return "pairing: not checked (no child logged train/rollout_crc at iteration 0)"
    bad = {s: len(set(v)) for s, v in first.items() if len(set(v)) > 1}
    skipped = f"; {unchecked} child(ren) logged no fingerprint" if unchecked else ""
    if not bad:
        many = [s for s, v in first.items() if len(v) > 1]
        return (f"pairing: exact — for each of {len(many)} seed(s) with several children, their first rollouts are "
                f"the same tokens (train/rollout_crc at iteration 0){skipped}")
    where = ", ".join(f"seed {s}: {k} different first rollouts among {len(first[s])} children" for s, k in bad.items())
    return (f"pairing: NOT exact — {where} (train/rollout_crc at iteration 0): the same start sampled different "
            f"tokens, so each paired difference also carries the rollout engine's run-to-run noise{skipped}")
