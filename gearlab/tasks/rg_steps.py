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
from fractions import Fraction

__all__ = ["worked_solution"]

_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def worked_solution(dataset: str, entry: dict) -> list[str] | None:
    """The lines ``"a op b = c"`` computing ``entry["metadata"]["expression"]`` step by step, or None when the
    dataset is not an integer-arithmetic one, the expression does not parse, a value is not an integer, or the
    result is not the entry's answer. An expression that is a bare number gives []."""
    from gearlab.tasks.rg_errors import ARITH_DATASETS

    if dataset not in ARITH_DATASETS:
        return None
    expr = str((entry.get("metadata") or {}).get("expression") or "")
    try:
        tree = ast.parse(expr, mode="eval").body
        lines: list[str] = []
        value = _walk(tree, lines, floor_div=dataset == "basic_arithmetic")
        if value is None or str(value) != str(entry["answer"]).replace(",", "").strip():
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
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        a, b = _walk(node.left, lines, floor_div), _walk(node.right, lines, floor_div)
        if a is None or b is None:
            return None
        op = _OPS[type(node.op)]
        if op == "+":
            c = a + b
        elif op == "-":
            c = a - b
        elif op == "*":
            c = a * b
        elif floor_div:
            c = a // b
        else:
            q = Fraction(a, b)
            if q.denominator != 1:
                return None
            c = int(q)
        lines.append(f"{a} {op} {b} = {c}")
        return c
    return None
