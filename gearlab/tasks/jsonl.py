"""Problems read from local JSON-lines files: ``{"prompt": ..., "answer": ...[, "solution": ...]}``.

The answer is the text after the last "Answer:" of the completion, else its last number; both
sides are compared after stripping whitespace, a trailing period and thousands separators.
A simple exact-match verifier: maths benchmarks with LaTeX answers need a symbolic verifier.
"""
from __future__ import annotations

import random
import re
from pathlib import Path

from gearlab.tasks.base import Problem, Task, load_jsonl_problems
from gearlab.tasks.registry import register_task

_ANSWER_RE = re.compile(r"Answer:\s*([^\n]+)")
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@register_task("jsonl")
class JsonlTask(Task):
    """train_path: the training file; test_path: the evaluation file (defaults to train_path)."""

    def __init__(self, train_path: str, test_path: str | None = None) -> None:
        if not train_path:
            raise ValueError("task 'jsonl' needs task.options.train_path")
        self.paths = {"train": Path(train_path), "test": Path(test_path or train_path)}
        self._rows: dict[str, list[Problem]] = {}
        for split, p in self.paths.items():  # read now: a bad file fails before any work
            if not p.is_file():
                raise ValueError(f"{split} file not found: {p}")
            self._rows[split] = load_jsonl_problems(p)
            if not self._rows[split]:
                raise ValueError(f"{p}: no problems")

    def problems(self, split: str, n: int, seed: int = 0) -> list[Problem]:
        rows = self._rows[split]
        if n <= len(rows):
            return random.Random(seed).sample(rows, n)
        rng = random.Random(seed)
        return [rows[rng.randrange(len(rows))] for _ in range(n)]

    def normalize_answer(self, answer: str) -> str:
        return answer.strip().rstrip(".").replace(",", "").strip()

    def extract_answer(self, completion: str) -> str | None:
        m = _ANSWER_RE.findall(completion)
        if m:
            return self.normalize_answer(m[-1])
        nums = _NUMBER_RE.findall(completion)
        return self.normalize_answer(nums[-1]) if nums else None
