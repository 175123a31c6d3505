"""``gearlab eval``: greedy accuracy and unbiased pass@k of a model on a task's test split."""
from __future__ import annotations

from typing import Any

import torch

from gearlab.config import Config
from gearlab.models.loading import load_for_evaluation
from gearlab.tasks.registry import task_from_config
from gearlab.trainer.evaluation import evaluate_model


@torch.no_grad()
def evaluate(cfg: Config) -> dict[str, Any]:
    task = task_from_config(cfg)
    model, tok, name = load_for_evaluation(cfg)
    if torch.cuda.is_available() and cfg.trainer.accelerator in ("auto", "gpu", "cuda"):
        model = model.cuda()
    return {"model": name, "task": cfg.task.name, **evaluate_model(model, tok, task, cfg)}


