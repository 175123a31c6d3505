"""Worked solutions for reasoning-gym's arithmetic datasets, which ship none: one line per operation.

reasoning-gym's ``chain_sum``, ``basic_arithmetic`` and ``products`` entries carry the expression
(``metadata["expression"]``) and the answer but no worked solution, so a warm start on them could only imitate the
answer line, and a response would have a single step (nothing for step-level credit or Monte-Carlo values to look
at). ``worked_solution`` writes the computation as gearlab's own arithmetic task does: the operations in the order
Python evaluates them (precedence and parentheses, then left to right), one ``a op b = c`` line each, each line's
operands being numbers of the problem or earlier results — the form ``gearlab.tasks.rg_errors`` checks line by line.

Conventions: numbers print as integers (every value of these datasets' integer expressions is one; a value that is
not is refused); a negation of a computed value (``-( 4 + -2 )``) is folded into the next operation's operand
without a line of its own; ``/`` in ``basic_arithmetic`` is floor division, as that dataset computes its answers.
The solution is returned only when its last value equals the entry's answer, so a demonstration is never wrong.
"""
from __future__ import annotations

import ast
import operator
from fractions import Fraction

from gearlab.tasks.rg_errors import ARITH_DATASETS, _arith_correct

__all__ = ["worked_solution"]

# the symbol each operation is written with and its value; "/" is _divide
_OPS = {ast.Add: ("+", operator.add), ast.Sub: ("-", operator.sub), ast.Mult: ("*", operator.mul)}


def worked_solution(dataset: str, entry: dict) -> list[str] | None:
    """The lines ``"a op b = c"`` computing ``entry["metadata"]["expression"]`` step by step, or None when the
    dataset is not an integer-arithmetic one, the expression does not parse, a value is not an integer, or the
    result is not the entry's answer. An expression that is a bare number gives []."""
    if dataset not in ARITH_DATASETS:
        return None
    expr = str((entry.get("metadata") or {}).get("expression") or "")
    try:
        tree = ast.parse(expr, mode="eval").body
        lines: list[str] = []
        value = _walk(tree, lines, floor_div=dataset == "basic_arithmetic")
        # the dataset's own reading of an answer (the error checker's copy of its scorer)
        if value is None or not _arith_correct(dataset, str(value), str(entry["answer"])):
            return None
        return lines
    except (SyntaxError, ValueError, ZeroDivisionError, KeyError, RecursionError):
        return None


def _walk(node: ast.AST, lines: list[str], floor_div: bool) -> int | None:
    """The integer value of ``node``, appending a line per binary operation (post-order, left to right)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _walk(node.operand, lines, floor_div)
        return None if inner is None else (-inner if isinstance(node.op, ast.USub) else inner)
    if isinstance(node, ast.BinOp) and (type(node.op) in _OPS or isinstance(node.op, ast.Div)):
        a, b = _walk(node.left, lines, floor_div), _walk(node.right, lines, floor_div)
        if a is None or b is None:
            return None
        if isinstance(node.op, ast.Div):
            symbol, c = "/", _divide(a, b, floor_div)
            if c is None:
                return None
        else:
            symbol, fn = _OPS[type(node.op)]
            c = fn(a, b)
        lines.append(f"{a} {symbol} {b} = {c}")
        return c
    return None


def _divide(a: int, b: int, floor: bool) -> int | None:
    """a / b: floored with ``floor``, else only when exact (None otherwise); b = 0 raises ZeroDivisionError."""
    if floor:
        return a // b
    q = Fraction(a, b)
    return int(q) if q.denominator == 1 else None
