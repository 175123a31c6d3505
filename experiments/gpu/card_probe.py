"""Whether a card repeats a comparison's stored bits: the first iterations of one finished child, run again on this
card (twice, each its own process), against the same child in the comparison's store. Per metric of
``rerun_check.KEYS`` and per run: the first iteration that differs from the store (null: none), and whether the two
runs here repeat each other.

    python experiments/gpu/card_probe.py STORE_DIR CHILD RUN_DIR [RUN_DIR ...] [--out probe.json]
    # STORE_DIR holds the comparison's mlflow.db; CHILD is its run name (rlsd-s0); RUN_DIR a probe's trainer.output_dir

Exit 0 when every probe run equals the store on every common iteration, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlflow
from mlflow_runs import newest_run
from rerun_check import KEYS, first_differences


def _history(client: mlflow.MlflowClient, run_id: str) -> dict[str, dict[int, float]]:
    return {k: {m.step: m.value for m in client.get_metric_history(run_id, k)} for k in (*KEYS, "eval/avg_at_4")}


def _stored(store: Path, child: str) -> dict[str, dict[int, float]]:
    client = mlflow.MlflowClient(f"sqlite:///{store.resolve() / 'mlflow.db'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
            if r.info.run_name == child]
    if not runs:
        sys.exit(f"{store}: no run named {child!r}")
    return _history(client, runs[0].info.run_id)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store", type=Path)
    ap.add_argument("child")
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    ref = _stored(args.store, args.child)
    got = {}
    for r in args.runs:
        client, run = newest_run(r)
        got[str(r)] = _history(client, run.info.run_id)
    out: dict = {"child": args.child, "vs_store": {r: first_differences(ref, h) for r, h in got.items()}}
    if len(got) > 1:
        first, *rest = got.values()
        out["runs_repeat_each_other"] = all(v["first_differing"] is None for h in rest
                                            for v in first_differences(first, h).values())
    out["equal_to_store"] = all(v["first_differing"] is None and (v["iterations"] > 0 or k == "eval/avg_at_4")
                                for res in out["vs_store"].values() for k, v in res.items())
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    sys.exit(0 if out["equal_to_store"] else 1)


if __name__ == "__main__":
    main()
