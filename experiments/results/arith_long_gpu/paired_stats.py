"""Per-seed numbers behind README.md, read from the committed MLflow store alone (issue 17).

    mkdir -p /tmp/store && tar xzf experiments/results/arith_long_gpu/run/mlflow-store.tgz -C /tmp/store
    python experiments/results/arith_long_gpu/paired_stats.py /tmp/store/mlflow.db

Prints each method's final held-out avg@4 and greedy accuracy per seed, the paired t-tests against grpo with a
Holm adjustment over the five comparisons (the report's table gives the intervals and MDE80; this adds the
family-wise reading), the greedy change from the start, and the per-iteration time split.
"""
from __future__ import annotations

import sys

import mlflow
import numpy as np
from scipy import stats

METHODS = ["grpo", "gear", "gear_random", "rlsd", "entropy_fork", "oar_g"]


def main(db: str) -> None:
    client = mlflow.MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name("compare/arith_long_gpu")
    runs = [r for r in client.search_runs([exp.experiment_id], max_results=1000) if "assigner" in r.data.tags]

    def hist(run_id: str, key: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]

    d = {}
    for r in runs:
        rid = r.info.run_id
        d[(r.data.tags["assigner"], int(r.data.tags["seed"]))] = {
            "avg": hist(rid, "eval/avg_at_4"), "greedy": hist(rid, "eval/greedy_accuracy"),
            "time": {k: float(np.mean(hist(rid, f"time/{k}"))) for k in ("rollout_s", "signals_credit_s", "update_s")}}
    seeds = sorted({s for _, s in d})
    final = {a: 100 * np.array([d[(a, s)]["avg"][-1] for s in seeds]) for a in METHODS}
    for a in METHODS:
        greedy = [round(100 * d[(a, s)]["greedy"][-1], 1) for s in seeds]
        print(f"{a:13s} avg@4 per seed {np.round(final[a], 2).tolist()}  greedy per seed {greedy}")
    print(
        f"start (every run): avg@4 {100 * d[('grpo', seeds[0])]['avg'][0]:.2f}%, greedy "
        f"{100 * d[('grpo', seeds[0])]['greedy'][0]:.1f}%"
    )
    tests = sorted(((a, stats.ttest_rel(final[a], final["grpo"]).pvalue, (final[a] - final["grpo"]).mean())
                    for a in METHODS[1:]), key=lambda x: x[1])
    holm = 0.0
    for i, (a, p, diff) in enumerate(tests):
        holm = max(holm, min(1.0, (len(tests) - i) * p))
        print(f"vs grpo: {a:13s} Δ {diff:+.2f} points  paired t p = {p:.3f}  Holm p = {holm:.3f}")
    t975 = stats.t.ppf(0.975, len(seeds) - 1)
    for a in METHODS:
        ch = 100 * np.array([d[(a, s)]["greedy"][-1] - d[(a, s)]["greedy"][0] for s in seeds])
        tm = {k: round(
            float(np.mean([d[(a, s)]["time"][k] for s in seeds])), 2
        ) for k in ("rollout_s", "signals_credit_s", "update_s")}
        print(f"{a:13s} greedy change {ch.mean():+.1f} ± {t975 * ch.std(ddof=1) / np.sqrt(len(seeds)):.1f} points; "
              f"per iteration {tm}")


if __name__ == "__main__":
    main(sys.argv[1])
