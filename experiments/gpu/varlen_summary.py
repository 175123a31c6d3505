"""Summarise a GPU run of the fast decode path from its MLflow store: tokens/s of the rollouts, decode ms/step, and
whether the compiled layers kept recompiling (``compile/graphs_total`` late in the run).

    python experiments/gpu/varlen_summary.py RUN_OUTPUT_DIR     # the trainer.output_dir of one gearlab train
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from mlflow_runs import newest_run


def main() -> None:
    client, run = newest_run(Path(sys.argv[1]))
    hist = lambda k: [m.value for m in sorted(client.get_metric_history(run.info.run_id, k), key=lambda m: m.step)]  # noqa: E731
    tokens, rollout = hist("train/generated_tokens_total"), hist("time/rollout_s")
    per_iter = [b - a for a, b in zip([0.0] + tokens[:-1], tokens)]
    graphs = hist("compile/graphs_total")
    later = rollout[1:] or rollout
    out = {"run_id": run.info.run_id, "engine": run.data.params.get("rollout.engine"), "iterations": len(rollout),
           "rollout_tokens_per_s_median": round(statistics.median(t / s for t, s in zip(per_iter[1:], rollout[1:])),
           1) if len(rollout) > 1 else None,
           "rollout_s_median": round(statistics.median(later), 3) if later else None,
           "response_len": hist("train/response_len")[-5:],
           "decode_ms_per_step_median": round(statistics.median(hist("fast/ms_per_step")[1:] or [0]), 3),
           "fast_graphs_captured_last": (hist("fast/graphs_captured") or [None])[-1],
           "compile_graphs_total": {"iter1": graphs[0] if graphs else None, "iter10": graphs[9] if len(
               graphs
           ) > 9 else None,
                                    "last": graphs[-1] if graphs else None},
           "eval": {k: v for k, v in run.data.metrics.items() if k.startswith("eval/")}}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
