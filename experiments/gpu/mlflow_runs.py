"""The newest MLflow run of one training run's output folder (its ``mlflow.db``), for the GPU summary scripts."""
from __future__ import annotations

import sys
from pathlib import Path

import mlflow


def newest_run(root: Path) -> tuple[mlflow.MlflowClient, mlflow.entities.Run]:
    """``(client, run)``: the run of ``root/mlflow.db`` that started last, over all its experiments; exits with
    one line naming the store when it holds no run."""
    client = mlflow.MlflowClient(f"sqlite:///{root.resolve() / 'mlflow.db'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    if not runs:
        sys.exit(f"{root}: no MLflow run in {root / 'mlflow.db'}")
    return client, max(runs, key=lambda r: r.info.start_time)
