"""Problems read from local JSON-lines files: ``{"prompt": ..., "answer": ...[, "solution": ...]}``.

The answer is the text after the last "Answer:" of the completion, else its last number; both
sides are compared after stripping whitespace, a trailing period and thousands separators.
A simple exact-match verifier: maths benchmarks with LaTeX answers need a symbolic verifier.
"""
from __future__ import annotations

import random
import re
from pathlib import Path

from gearlab.tasks.base import Problem, Task, load_jsonl_rows
from gearlab.tasks.registry import register_task

_ANSWER_RE = re.compile(r"Answer:\s*([^\n]+)")
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@register_task("jsonl")
class JsonlTask(Task):
    """train_path: the training file; test_path: the held-out evaluation file. Without it the evaluation uses the
    training problems (``held_out`` is False), and training and evaluation say so."""

    def __init__(self, train_path: str, test_path: str | None = None) -> None:
        if not train_path:
            raise ValueError("task 'jsonl' needs task.options.train_path")
        self.paths = {"train": Path(train_path), "test": Path(test_path or train_path)}
        # no separate test file: evaluations run on the training problems (and must not be called held-out)
        self.held_out = self.paths["test"].resolve() != self.paths["train"].resolve()
        self._rows: dict[str, list[Problem]] = {}
        self._sourced: dict[Path, list[tuple[str, Problem]]] = {}
        for split, p in self.paths.items():  # read now: a bad file fails before any work
            if not p.is_file():
                raise ValueError(f"{split} file not found: {p}")
            if p not in self._sourced:
                self._sourced[p] = load_jsonl_rows(p)
            self._rows[split] = [prob for _, prob in self._sourced[p]]
            if not self._rows[split]:
                raise ValueError(f"{p}: no problems")

    def sourced_problems(self) -> list[tuple[str, Problem]]:
        return [row for rows in self._sourced.values() for row in rows]

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
