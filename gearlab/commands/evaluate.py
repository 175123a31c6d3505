"""``gearlab eval``: greedy accuracy and unbiased pass@k of a model on a task's test split."""
from __future__ import annotations

from typing import Any

import torch

from gearlab.config import Config
from gearlab.models.loading import load_for_evaluation
from gearlab.models.prompt_length import check_prompt_lengths
from gearlab.tasks.registry import task_from_config
from gearlab.trainer.evaluation import evaluate_model


@torch.no_grad()
def evaluate(cfg: Config) -> dict[str, Any]:
    task = task_from_config(cfg)
    model, tok, name = load_for_evaluation(cfg)
    check_prompt_lengths(cfg, task, tok, model.config)
    split = "test (held out)" if getattr(
        task, "held_out", True
    ) else "train (the task has no separate test split: not held out)"
    return {"model": name, "task": cfg.task.name, "problems_from": split, **evaluate_model(model, tok, task, cfg)}


