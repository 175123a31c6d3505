"""The report's curves: training accuracy per method (mean over seeds, 95% t band), the paired difference to the
baseline per iteration, and the final metric per seed."""
from __future__ import annotations

from pathlib import Path

from gearlab.core.power import t_interval

CURVE = "train/accuracy"
SMOOTH = 5


def _smooth(vals: list[float], w: int = SMOOTH) -> list[float]:
    return [sum(vals[max(0, i - w + 1): i + 1]) / len(vals[max(0, i - w + 1): i + 1]) for i in range(len(vals))]


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


def _band(
    series: list[list[float]], bounds: tuple[float, float] | None = None
) -> tuple[list[float], list[float], list[float]]:
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
          baseline: str, curve: str = CURVE) -> None:
    """Left: ``curve`` per iteration, training accuracy by default (mean over seeds, 95% t band). Middle: the paired
    per-seed difference to the baseline (the same prompts make this far less noisy). Right: final metric per seed
    and its mean ± 95% t."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, axd, ax2) = plt.subplots(1, 3, figsize=(16, 4.2), gridspec_kw={"width_ratios": [3, 3, 1.3]})
    base = {s: _smooth(v) for s, v in curves.get(baseline, {}).items()}
    b = _bounds(curve, [v for runs in curves.values() for r in runs.values() for v in r])
    what = "training accuracy" if curve == CURVE else curve
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
    ax.set_title(f"{what} ({SMOOTH}-iteration mean)\n(line: mean over seeds; band: 95% t)", fontsize=8)
    axd.set_title(f"paired difference to {baseline}, per seed\n(line: mean over seeds; band: 95% t)", fontsize=8)
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"{what} ({SMOOTH}-iteration mean)")
    ax.legend(fontsize=8)
    axd.axhline(0, color="k", lw=0.8)
    axd.set_xlabel("iteration")
    axd.set_ylabel(f"paired difference of {what}")
    axd.legend(fontsize=8)
    for a_ in (ax, axd, ax2):
        a_.grid(alpha=0.3)
    ax2.set_xticks(range(len(curves)), list(curves), rotation=45, fontsize=8)
    ax2.set_title(f"final {metric}\n(dots: seeds; bar: mean ± 95% t)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
