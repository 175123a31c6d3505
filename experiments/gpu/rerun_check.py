"""Whether two runs of one configuration repeated each other bit for bit: every iteration's ``train/rollout_crc``,
``train/data_crc``, ``train/reward``, ``train/adv_abs_mean``, ``update/pg_loss`` and ``update/grad_norm`` (the tokens
sampled, the prompts, what they earned, the credit, the update), read from each run's MLflow store.

    python experiments/gpu/rerun_check.py RUN_DIR_A RUN_DIR_B [--out rerun.json]   # trainer.output_dir of each run

Prints one JSON object: per metric, the first iteration where the runs differ (null: none), and
``iterations_with_signal``, the iterations of run A with a non-zero advantage (0: the check shows little, since no
credit moved the update); exit 1 if any differ.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mlflow_runs import newest_run

KEYS = ("train/rollout_crc", "train/data_crc", "train/reward", "train/adv_abs_mean", "update/pg_loss",
        "update/grad_norm")


def _histories(root: Path) -> dict[str, dict[int, float]]:
    """The newest run in ``root/mlflow.db``: {metric: {iteration: value}} for :data:`KEYS`."""
    client, run = newest_run(root)
    return {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)} for k in KEYS}


def first_differences(a: dict[str, dict[int, float]], b: dict[str, dict[int, float]]) -> dict:
    """Per metric of ``a``: the iterations both histories have, the first where they differ (None: none) and the two
    values there."""
    out = {}
    for k in a:
        steps = sorted(set(a[k]) & set(b[k]))
        differ = [s for s in steps if a[k][s] != b[k][s]]
        out[k] = {"iterations": len(steps), "first_differing": differ[0] if differ else None,
                  "values_at_first": [a[k][differ[0]], b[k][differ[0]]] if differ else None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    a = _histories(args.a)
    out: dict = first_differences(a, _histories(args.b))
    out["repeated"] = all(v["first_differing"] is None and v["iterations"] > 0 for v in out.values())
    # a run whose groups all scored alike has every advantage 0: its update moves nothing the credit decides, so
    # equal runs then show little; say how many iterations carried a learning signal
    out["iterations_with_signal"] = sum(v > 0 for v in a["train/adv_abs_mean"].values())
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    sys.exit(0 if out["repeated"] else 1)


if __name__ == "__main__":
    main()
