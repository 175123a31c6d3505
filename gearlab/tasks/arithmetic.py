"""Embedded arithmetic task: short operator chains a tiny model can learn on a CPU.

A problem is a chain of `num_steps` binary operations over integers in [1, max_operand],
evaluated strictly LEFT TO RIGHT (no operator precedence; the prompt says so), e.g.

    prompt:   "Compute 7 + 5 * 3 left to right."
    solution: "7+5=12\\n12*3=36\\nAnswer: 36"          (≈ 20 tokens with the tiny tokenizer)

Left-to-right keeps the trace one line per step with no parentheses, so responses stay short
(response length dominates CPU cost). Intermediate results may be negative ("3-8=-5").

Difficulty grows with `num_steps` and `max_operand`; "arith" (2 steps, operands ≤ 9) is the
default, "arith_hard" (4 steps, operands ≤ 20) a harder preset.

Train/test split: a problem belongs to "test" iff a hash of its canonical expression falls below
`test_fraction`, independent of any seed, so the splits are disjoint for every seed.

Error location (:meth:`ArithmeticTask.locate_error`): the completion's lines are checked against the
chain one step at a time, and the first line that breaks it is the wrong step (rules in the method).
"""
from __future__ import annotations

import hashlib
import random
import re

from gearlab.tasks.base import Problem, Task, line_spans
from gearlab.tasks.registry import register_task

__all__ = ["ArithmeticTask", "evaluate_chain"]

_OPS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}

# Last "Answer:" wins; the number may be negative. Bounded length: int() of a huge digit string
# raises in CPython (>4300 digits) and no true answer here is that long.
_ANSWER_RE = re.compile(r"Answer:\s*(-?\d{1,40})(?!\d)")
_ANSWER_MARKER = "Answer:"
# One step line "L<op>R=V" (the whole line): integers may be negative, spaces allowed between the parts.
_STEP_RE = re.compile(r"\s*(-?\d{1,40})\s*([-+*])\s*(-?\d{1,40})\s*=\s*(-?\d{1,40})\s*")


def evaluate_chain(operands: list[int], ops: list[str]) -> list[int]:
    """Left-to-right evaluation; returns the running value after each op (len(ops) values)."""
    acc = operands[0]
    trace = []
    for op, b in zip(ops, operands[1:]):
        acc = _OPS[op](acc, b)
        trace.append(acc)
    return trace


@register_task("arith")
@register_task("arith_hard", num_steps=4, max_operand=20)
class ArithmeticTask(Task):
    """Left-to-right integer operator chains with a step-by-step solution.

    Args:
        num_steps:     operations per problem (operands = num_steps + 1).
        max_operand:   operands are drawn uniformly from [min_operand, max_operand].
        ops:           allowed operators, a subset of "+-*".
        seed:          default seed for `problems` when none is given.
        min_operand:   smallest operand (1 by default: "x*0" chains are degenerate).
        test_fraction: share of the problem space reserved for the "test" split.
    """

    name = "arith"

    def __init__(
        self,
        num_steps: int = 2,
        max_operand: int = 9,
        ops: str = "+-*",
        seed: int = 0,
        min_operand: int = 1,
        test_fraction: float = 0.2,
    ) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        if not ops or any(o not in _OPS for o in ops):
            raise ValueError(f"ops must be a non-empty subset of {''.join(_OPS)!r}, got {ops!r}")
        if not 0 <= min_operand <= max_operand:
            raise ValueError(f"need 0 <= min_operand <= max_operand, got {min_operand}, {max_operand}")
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        self.num_steps = num_steps
        self.max_operand = max_operand
        self.min_operand = min_operand
        self.ops = "".join(dict.fromkeys(ops))  # dedupe, keep order
        self.seed = seed
        self.test_fraction = test_fraction

    # -- problem generation -------------------------------------------------------------------

    @property
    def space_size(self) -> int:
        """Number of distinct problems (both splits together)."""
        n_vals = self.max_operand - self.min_operand + 1
        return n_vals ** (self.num_steps + 1) * len(self.ops) ** self.num_steps

    def split_of(self, expr: str) -> str:
        """"test" or "train" for the canonical expression `expr` (e.g. "7+5*3"); seed-free."""
        h = int.from_bytes(hashlib.sha256(expr.encode()).digest()[:8], "big")
        return "test" if h / 2**64 < self.test_fraction else "train"

    def make_problem(self, operands: list[int], ops: list[str]) -> Problem:
        """Build the Problem for a given chain (used by `problems` and by tests)."""
        trace = evaluate_chain(operands, ops)
        lines = []
        left = operands[0]
        for op, b, res in zip(ops, operands[1:], trace):
            lines.append(f"{left}{op}{b}={res}")
            left = res
        answer = str(trace[-1])
        lines.append(f"Answer: {answer}")
        pretty = " ".join(
            [str(operands[0])] + [f"{op} {b}" for op, b in zip(ops, operands[1:])]
        )
        return Problem(
            prompt=f"Compute {pretty} left to right.",
            answer=answer,
            solution="\n".join(lines),
            meta={"operands": list(operands), "ops": list(ops), "expr": _expr(operands, ops)},
        )

    def problems(self, split: str, n: int, seed: int | None = None) -> list[Problem]:
        """`n` problems of `split`, deterministic given `seed` (default: the task's seed).

        Problems are distinct while `n` is at most half the split's expected size; beyond that
        they are drawn with replacement (e.g. long training streams).
        """
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        seed = self.seed if seed is None else seed
        rng = random.Random(f"arith/{split}/{seed}")
        share = self.test_fraction if split == "test" else 1.0 - self.test_fraction
        unique = n <= 0.5 * share * self.space_size
        seen: set[str] = set()
        out: list[Problem] = []
        while len(out) < n:
            operands = [rng.randint(self.min_operand, self.max_operand) for _ in range(self.num_steps + 1)]
            ops = [rng.choice(self.ops) for _ in range(self.num_steps)]
            expr = _expr(operands, ops)
            if self.split_of(expr) != split or (unique and expr in seen):
                continue
            seen.add(expr)
            out.append(self.make_problem(operands, ops))
        return out

    # -- verification ---------------------------------------------------------------------------

    def extract_answer(self, completion: str) -> str | None:
        """Integer after the last "Answer:" in `completion`, normalised (e.g. "007" -> "7")."""
        if not isinstance(completion, str):
            return None
        matches = _ANSWER_RE.findall(completion)
        if not matches:
            return None
        try:
            return str(int(matches[-1]))
        except ValueError:
            return None

    def normalize_answer(self, answer: str) -> str:
        try:
            return str(int(str(answer).strip()))
        except ValueError:
            return str(answer).strip()

    def locate_error(self, problem: Problem, completion: str) -> tuple[int, int] | None:
        """Span of the first line of `completion` that breaks the chain (see :meth:`Task.locate_error`).

        None when the completion is correct — ``reward == 1.0``, even if a step on the way was wrong
        (the outcome is what counts as correct) — or when `problem` has no chain (``meta`` without
        ``operands``/``ops``). Otherwise the span of one line, its newline (and a trailing "\\r")
        excluded. Blank (whitespace-only) lines are skipped everywhere: they are never a step, nor
        blamed. Lines are walked in order; step k (0-based) is expected while k < num_steps:

        * a step line is ``L<op>R=V`` (the whole line; integers may be negative, spaces allowed).
          Step k is wrong when it misreads the chain (op != ops[k], R != operands[k+1], or, for k=0,
          L != operands[0]), continues from a value the previous line did not state (k>0:
          L != the previous line's V — earlier lines are all correct here, since the walk stops at the
          first wrong one), or miscomputes (V != L op R);
        * where a step is expected, any other line is wrong at that line: garbage, a truncated step,
          and an "Answer:" line that comes before all steps were written (too few steps);
        * the completion ends with steps missing and no answer: the last non-blank line (the correct
          step after which it stopped — the stop itself has no characters to point at);
        * after a correct chain, the first line that is not an "Answer:" line stating the correct
          answer: an extra step, garbage, or a wrong/valueless "Answer:" line;
        * a correct chain followed by nothing (missing answer line, nothing written after the last
          correct step): None;
        * a completion with no non-blank line: the whole completion when it is whitespace, None
          when it is empty.
        """
        try:
            return self._locate_error(problem, completion)
        except Exception:  # never raise on odd text (or odd meta)
            return None

    def _locate_error(self, problem: Problem, completion: str) -> tuple[int, int] | None:
        if not isinstance(completion, str) or "operands" not in problem.meta or "ops" not in problem.meta:
            return None
        operands = [int(x) for x in problem.meta["operands"]]
        ops = [str(o) for o in problem.meta["ops"]]
        if not ops or len(operands) != len(ops) + 1 or any(o not in _OPS for o in ops):
            return None
        if self.reward(problem, completion) == 1.0:
            return None
        lines = [(s, e) for s, e in line_spans(completion) if completion[s:e].strip()]
        if not lines:
            return (0, len(completion)) if completion else None
        want = self.normalize_answer(problem.answer)
        k, stated = 0, operands[0]  # next expected step; the value it must continue from
        for s, e in lines:
            line = completion[s:e]
            if k < len(ops):
                m = None if _ANSWER_MARKER in line else _STEP_RE.fullmatch(line)
                if m is None:
                    return s, e
                left, op, right, value = int(m[1]), m[2], int(m[3]), int(m[4])
                if left != stated or op != ops[k] or right != operands[k + 1] or value != _OPS[op](left, right):
                    return s, e
                k, stated = k + 1, value
                continue
            got = _ANSWER_RE.findall(line) if _ANSWER_MARKER in line else []
            if not got or self.normalize_answer(got[-1]) != want:
                return s, e  # extra step, garbage, or a wrong / valueless answer after a correct chain
        if k < len(ops):
            return lines[-1]  # ran out of lines with steps missing (and no answer line)
        return None  # correct chain, no answer: nothing written after the last correct step

    def __repr__(self) -> str:
        return (
            f"ArithmeticTask(name={self.name!r}, num_steps={self.num_steps}, "
            f"max_operand={self.max_operand}, ops={self.ops!r})"
        )




def _expr(operands: list[int], ops: list[str]) -> str:
    """Canonical compact expression, e.g. "7+5*3" (the key of the split hash)."""
    return str(operands[0]) + "".join(f"{op}{b}" for op, b in zip(ops, operands[1:]))
