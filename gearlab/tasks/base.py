"""Task interface: problems with ground truth, chat prompts (plain and privileged) and a reward.

A `Task` yields `Problem`s, turns one into chat messages for the policy (plain) or for the
self-distillation teacher (privileged: the same question plus the ground-truth answer), and scores
a completion with an outcome reward. Concrete tasks register themselves with ``@register_task``
(``gearlab.tasks.registry``); this module knows none of them.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Problem",
    "Task",
    "load_jsonl_problems",
    "line_spans",
    "load_jsonl_rows",
    "privileged_suffix",
    "read_utf8",
    "sample_cycling",
]


@dataclass(frozen=True)
class Problem:
    """One question with its ground truth.

    prompt:   user-facing question text (no chat markup)
    answer:   ground-truth final answer, as a string
    solution: worked solution ending with the final-answer line (may be "" for loaded data)
    meta:     free-form extra data (e.g. the operands of a generated problem)
    """

    prompt: str
    answer: str
    solution: str = ""
    meta: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


def privileged_suffix(answer: str) -> str:
    """Text appended to the user message in the privileged (teacher) context."""
    return f"\n(Reference answer: {answer})"


class Task(ABC):
    """A source of problems plus a verifier.

    Subclasses set `name` and implement `problems`, `extract_answer` and may override `reward`,
    `system_prompt` or `messages`.
    """

    name: str = "task"
    #: True when episodes have several turns (turn_ids / turn_rewards in the rollout); turn-level
    #: credit methods refuse single-turn tasks.
    multi_turn: bool = False
    #: Optional system message; None = no system turn (keeps prompts short for tiny models).
    system_prompt: str | None = None
    #: Multi-turn tasks: the default turn limit of an episode (``rollout.max_turns=0`` uses it).
    max_turns: int = 1
    #: Multi-turn tasks: whether a fresh environment answers the same actions with the same observations, so an
    #: episode can be replayed up to a turn and continued (Monte-Carlo values, ``vineppo``). An environment with
    #: outside state (a clock, a live service) sets False; methods that replay then refuse the task.
    replayable: bool = True
    #: False when the "test" split is the training problems themselves (a data file without a separate test file):
    #: an evaluation on it then measures fitting, not generalisation, and gearlab says so instead of "held-out".
    held_out: bool = True

    def make_env(self, problem: Problem) -> "Any":
        """A fresh :class:`gearlab.envs.base.Environment` for one episode of `problem` (multi-turn
        tasks only). Its ``reset()`` returns the user message ``messages(problem)`` shows."""
        raise NotImplementedError(f"task {self.name!r} is single-turn: it has no environment")

    def demo_actions(self, problem: Problem) -> list[str]:
        """Multi-turn tasks: a correct sequence of actions for `problem` (the warm start imitates it)."""
        raise NotImplementedError(f"task {self.name!r} has no demonstrations")

    @abstractmethod
    def problems(self, split: str, n: int, seed: int = 0) -> list[Problem]:
        """`n` problems of `split` ("train" or "test"), deterministic given `seed`.

        The train and test splits never share a problem, except in a task whose ``held_out`` is False.
        """

    @abstractmethod
    def extract_answer(self, completion: str) -> str | None:
        """The final answer stated in `completion`, normalised, or None if there is none."""

    def messages(self, problem: Problem, privileged: bool | str = False) -> list[dict[str, str]]:
        """Chat messages for `problem`: [system?] + user.

        privileged=True or "answer" appends the ground-truth answer to the user message; "solution"
        appends the worked solution (falls back to the answer when there is none). This is the
        context of the self-distillation teacher, which scores the student's response given it.
        """
        user = problem.prompt
        if privileged == "solution" and problem.solution:
            user += f"\n(Reference solution:\n{problem.solution})"
        elif privileged:
            user += privileged_suffix(problem.answer)
        msgs: list[dict[str, str]] = []
        if self.system_prompt:
            msgs.append({"role": "system", "content": self.system_prompt})
        msgs.append({"role": "user", "content": user})
        return msgs

    def normalize_answer(self, answer: str) -> str:
        """Canonical form used to compare answers (default: stripped text)."""
        return answer.strip()

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 if the extracted final answer equals the ground truth, else 0.0. Never raises."""
        try:
            got = self.extract_answer(completion)
        except Exception:  # a verifier must not crash a rollout on odd text
            return 0.0
        if got is None:
            return 0.0
        return 1.0 if got == self.normalize_answer(problem.answer) else 0.0

    def step_ends(self, completion: str) -> list[int]:
        """Where the reasoning steps of ``completion`` end: increasing character offsets (exclusive), the last one
        ``len(completion)``. Monte-Carlo values are estimated at these points (``gearlab.rollout.mc``). Default: each
        line is a step, its newline included; blank lines belong to the step after them. A task with other steps
        (turns, sentences, equations) overrides it."""
        ends = [i + 1 for i, ch in enumerate(completion) if ch == "\n" and completion[i + 1:].strip()
                and completion[:i].strip() and completion[i - 1] != "\n"] if completion else []
        return [e for e in ends if e < len(completion)] + [len(completion)]

    def sourced_problems(self) -> list[tuple[str, Problem]]:
        """Every problem this task read from a data file, with where it came from (the file and its 1-based line or
        row, as the task's own load errors name it), in file order; load-time checks such as the prompt-length limit
        report through it. Generated tasks read nothing: the default is empty."""
        return []

    def locate_error(self, problem: Problem, completion: str) -> tuple[int, int] | None:
        """Where `completion` first went wrong: the character span ``(start, end)`` (end exclusive, in
        `completion`'s own coordinates) of its FIRST wrong step, or None.

        This is ground truth for credit assignment (which tokens caused the failure), available only
        where the task can check intermediate steps. Contract for implementations:

        * None when the completion is correct (its outcome is a success) or when the task cannot
          tell where the error is (this default: no task-specific checker);
        * otherwise ``0 <= start < end <= len(completion)``: spans are never empty — an error with
          no characters to point at is reported as None;
        * never raises, whatever the text (like :meth:`reward`).

        What a "step" is, and the span of a step, are the task's to document. For a multi-turn task
        `completion` is the episode transcript the multi-turn engine records (``meta["texts"]``) and
        the span covers policy-written text only.
        """
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def read_utf8(path: str | Path) -> str:
    """The text of a data file; a byte that is not UTF-8 raises ValueError naming the file and its 1-based line."""
    path = Path(path)
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(_utf8_error(path, data, e)) from None


def _utf8_error(path: Path, data: bytes, e: UnicodeDecodeError, first_line: int = 1) -> str:
    line = first_line + data.count(b"\n", 0, e.start)
    column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
    return f"{path}:{line}: not valid UTF-8 (byte 0x{data[e.start]:02x} at column {column})"


def load_jsonl_problems(path: str | Path) -> list[Problem]:
    """Read problems from a JSON-lines file with keys "prompt", "answer" and optional "solution".

    Other keys go to `Problem.meta`. Blank lines are skipped. A bad row raises ValueError naming
    the file and the 1-based line number.
    """
    return [p for _, p in load_jsonl_rows(path)]


def load_jsonl_rows(path: str | Path) -> list[tuple[str, Problem]]:
    """``load_jsonl_problems`` with where each problem came from: ``("FILE:LINE", problem)`` pairs."""
    path = Path(path)
    out: list[tuple[str, Problem]] = []
    with path.open("rb") as fh:  # bytes, decoded line by line: an encoding error is reported with its line
        for line_no, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(_utf8_error(path, raw, e, line_no)) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg})") from e
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_no}: row is not a JSON object")
            for key in ("prompt", "answer"):
                if key not in row or row[key] is None:
                    raise ValueError(f"{path}:{line_no}: row has no {key!r}")
            meta = {k: v for k, v in row.items() if k not in ("prompt", "answer", "solution")}
            out.append((
                f"{path}:{line_no}",
                Problem(
                    prompt=str(row["prompt"]),
                    answer=str(row["answer"]),
                    solution=str(row.get("solution") or ""),
                    meta=meta,
                ),
            ))
    return out


def sample_cycling(pool: list[Problem], n: int, key: str) -> list[Problem]:
    """`n` problems from `pool`, shuffled by a ``random.Random(key)`` stream; the pool is reshuffled and
    repeated when `n` exceeds it (file-backed tasks with few rows)."""
    import random

    rng = random.Random(key)
    out: list[Problem] = []
    while len(out) < n:
        order = pool[:]
        rng.shuffle(order)
        out += order[: n - len(out)]
    return out


def line_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of every line of `text`, its "\\n" (and a "\\r" before it) excluded (located-error spans)."""
    out, start = [], 0
    while True:
        nl = text.find("\n", start)
        end = len(text) if nl < 0 else nl
        out.append((start, end - 1 if end > start and text[end - 1] == "\r" else end))
        if nl < 0:
            return out
        start = nl + 1
