"""Per-iteration metric histories of the calibration runs' MLflow stores, printed and written as one JSON.

    python experiments/gpu/rl_histories.py OUT.json LABEL_PREFIX 'RUN_GLOB/mlflow.db' KEY [KEY ...]

Each store's folder name after LABEL_PREFIX's last path piece names its row (e.g. ``/tmp/cal/rl_1e-5`` → ``1e-5``);
``eval/*`` histories are printed whole, the others every 4th iteration.
"""
import glob
import json
import sys

import mlflow


def main() -> None:
    out, prefix, pattern, *keys = sys.argv[1:]
    rows = {}
    for db in sorted(glob.glob(pattern)):
        c = mlflow.MlflowClient(f"sqlite:///{db}")
        for e in c.search_experiments():
            for r in c.search_runs([e.experiment_id]):
                h = {k: [(m.step, round(m.value, 4)) for m in c.get_metric_history(r.info.run_id, k)] for k in keys}
                label = "grpo lr=" + db.split(prefix)[-1].split("/")[0]
                rows[label] = h
                print(label, json.dumps({k: (v if k.startswith("eval") else v[::4]) for k, v in h.items()}))
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
