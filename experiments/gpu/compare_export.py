"""Every iteration of a comparison's children, read from its MLflow store, as one JSON (the committed
``experiments/results/<name>/compare*_paired.json`` files).

    python experiments/gpu/compare_export.py STORE_DIR EXPERIMENT OUT.json [--seeds 1,2] [--meta KEY=VALUE ...]

STORE_DIR holds ``mlflow.db`` (e.g. the extracted ``<experiment>-store.tgz``). Per child (run name, e.g.
``gear-s1``): the histories of the keys below as ``[[iteration, value], ...]``, the median seconds per iteration
of each timed phase, its final ``credit_eval/*`` metrics and the tags that say what ran (git sha, torch, CPU,
seed, assigner). ``--seeds`` keeps only those seeds; ``--meta`` adds fields (card, date, command) to ``meta``.
"""
import argparse
import json
import statistics
from pathlib import Path

import mlflow

HISTORIES = ("eval/avg_at_4", "eval/greedy_accuracy", "eval/pass_at_4", "train/reward", "train/frac_zero_std",
             "train/response_len", "train/nonfinite_steps_total", "train/data_crc", "train/rollout_crc")
TIMES = ("time/rollout_s", "time/signals_credit_s", "time/update_s", "time/eval_s")
TAGS = ("git_sha", "versions.torch", "versions.cpu_model", "seed", "assigner")


def export_child(client: mlflow.MlflowClient, run) -> dict:
    """One child's histories, median phase times, credit-eval metrics and identifying tags."""
    rid = run.info.run_id
    out = {k: [[m.step, round(m.value, 6)] for m in sorted(client.get_metric_history(rid, k), key=lambda m: m.step)]
           for k in HISTORIES}
    out["median_s"] = {k: round(statistics.median(m.value for m in h), 2)
                       for k in TIMES if (h := client.get_metric_history(rid, k))}
    out["credit_eval"] = {k: round(v, 4) for k, v in sorted(run.data.metrics.items()) if k.startswith("credit_eval/")}
    out["tags"] = {k: run.data.tags[k] for k in TAGS if k in run.data.tags}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("store")
    ap.add_argument("experiment", help="the comparison's name (MLflow experiment compare/<name>)")
    ap.add_argument("out")
    ap.add_argument("--seeds", default="", help="comma-separated seeds to keep (default: all)")
    ap.add_argument("--meta", nargs="*", default=[], help="KEY=VALUE fields of the file's meta")
    a = ap.parse_args()
    client = mlflow.MlflowClient(f"sqlite:///{Path(a.store).resolve() / 'mlflow.db'}")
    exp = client.get_experiment_by_name(f"compare/{a.experiment}")
    if exp is None:
        raise SystemExit(f"compare_export: no experiment compare/{a.experiment} in {a.store}")
    keep = set(a.seeds.split(",")) if a.seeds else None
    runs = {}
    for r in sorted(client.search_runs([exp.experiment_id]), key=lambda r: r.info.run_name):
        if keep is None or r.data.tags.get("seed") in keep:
            runs[r.info.run_name] = export_child(client, r)
    meta = dict(kv.split("=", 1) for kv in a.meta)
    Path(a.out).write_text(json.dumps({"meta": meta, "runs": runs}, indent=1) + "\n")
    for name, r in runs.items():
        ev = r["eval/avg_at_4"]
        print(f"{name}: avg@4 {ev[0][1]:.4f} -> {ev[-1][1]:.4f} over {ev[-1][0]} iterations; median_s {r['median_s']}")


if __name__ == "__main__":
    main()
