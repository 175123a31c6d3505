"""Whether ``rollout.max_new_tokens`` holds the task's answers. A completion cut before its answer scores 0, so a
budget shorter than the task's worked solutions gives a run of all-zero rewards, which no loss curve shows as wrong
(``trainer.no_signal_patience`` stops it a few iterations later, without saying why). Measured on the worked solutions
the task ships (``Problem.solution``), tokenised as the warm start trains them; a task without them is not checked.
"""
from __future__ import annotations

import statistics
from typing import Any

from gearlab.config import Config
from gearlab.tasks.base import Task

__all__ = ["answer_lengths", "answer_budget_warning"]


def answer_lengths(task: Task, tokenizer: Any, n: int = 64, seed: int = 0) -> list[int]:
    """Tokens of the worked solutions of ``n`` train problems (seed ``seed``), each with its end-of-sequence token:
    what a policy that answers like the demonstrations generates. Problems without a solution are left out."""
    solutions = [p.solution for p in task.problems("train", n, seed=seed) if p.solution.strip()]
    if not solutions:
        return []
    ids = tokenizer(solutions, add_special_tokens=False)["input_ids"]
    return [len(x) + 1 for x in ids]


def answer_budget_warning(cfg: Config, task: Task, tokenizer: Any, n: int = 64) -> str | None:
    """One line when the median worked solution of ``n`` train problems needs more tokens than
    ``rollout.max_new_tokens`` (then a policy warm-started on them is cut before its answer on most problems); None
    when it fits, for multi-turn tasks (their budget is per turn) and for tasks that ship fewer than ``n // 2``
    worked solutions."""
    if task.multi_turn:
        return None
    lengths = answer_lengths(task, tokenizer, n, seed=cfg.trainer.seed)
    budget = cfg.rollout.max_new_tokens
    if len(lengths) < n // 2 or statistics.median(lengths) <= budget:
        return None
    cut = sum(x > budget for x in lengths)
    return (f"key 'rollout.max_new_tokens': {budget} tokens cut {cut} of {len(lengths)} worked solutions of task "
            f"{cfg.task.name!r} before their answer (median {statistics.median(lengths):g} tokens, longest "
            f"{max(lengths)}): a policy that answers as they do scores 0 where it is cut; set "
            f"rollout.max_new_tokens={max(lengths)} or more")
