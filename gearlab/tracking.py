"""MLflow as the record of every run: Lightning's MLFlowLogger with sanitised keys, standard tags,
the flattened config as params, and a run id kept beside the checkpoints so a resumed run
continues the same MLflow run."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any, Mapping

from lightning.pytorch.loggers import MLFlowLogger

from gearlab.config import Config, flatten, to_yaml
from gearlab.metrics import sanitize_metric_key


def tracking_uri(cfg: Config) -> str:
    """cfg.logging.tracking_uri, else $MLFLOW_TRACKING_URI, else a SQLite file under the output dir."""
    if cfg.logging.tracking_uri:
        return cfg.logging.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path(cfg.trainer.output_dir).resolve() / 'mlflow.db'}"


def git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class GearlabMLFlowLogger(MLFlowLogger):
    """MLFlowLogger whose metric keys are made MLflow-safe without losing meaning (``pass@4`` → ``pass_at_4``)."""

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        super().log_metrics({sanitize_metric_key(k): v for k, v in metrics.items()}, step=step)

    def log_hyperparams(self, params: Any) -> None:
        # params are logged once, flattened, by make_logger; Lightning's own dump would duplicate them
        return None


def make_logger(cfg: Config, run_dir: Path, *, model_name: str) -> GearlabMLFlowLogger | None:
    """Create (or, when ``run_dir/mlflow_run_id`` exists, reopen) the MLflow run of this training run.
    None on every process but global rank 0."""
    id_file = run_dir / "mlflow_run_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else None
    tags = {"assigner": cfg.assigner.name, "seed": str(cfg.trainer.seed), "task": cfg.task.name,
            "model": model_name, "git_sha": git_sha(), **dict(cfg.logging.tags)}
    if cfg.logging.parent_run_id:
        tags["mlflow.parentRunId"] = cfg.logging.parent_run_id
    from lightning.pytorch.utilities import rank_zero_only

    if rank_zero_only.rank != 0:
        # launched by torchrun / srun, every rank runs this: only global rank 0 opens the store (two
        # processes creating one SQLite schema at once collide) and logs
        return None
    logger = GearlabMLFlowLogger(experiment_name=cfg.logging.experiment, run_name=run_dir.name,
                                 tracking_uri=tracking_uri(cfg), tags=tags, run_id=run_id)
    # Lightning calls mlflow.set_tracking_uri, which also exports MLFLOW_TRACKING_URI: undo that so a
    # later run in this process (a comparison, a test) does not inherit this run's store.
    env_before = os.environ.get("MLFLOW_TRACKING_URI")
    client, rid = logger.experiment, logger.run_id
    if env_before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = env_before
    if run_id is None:
        run_dir.mkdir(parents=True, exist_ok=True)
        id_file.write_text(rid)
        params = {k: ("" if v is None else str(v))[:6000] for k, v in flatten(cfg).items()}
        from mlflow.entities import Param

        items = list(params.items())
        for s in range(0, len(items), 100):
            client.log_batch(rid, params=[Param(k, v) for k, v in items[s : s + 100]])
        client.log_text(rid, to_yaml(cfg), "config.yaml")
    else:
        client.update_run(rid, status="RUNNING")
        client.set_tag(rid, "resumed", "true")
    return logger
