"""Tools a policy can call: a calculator and a Python interpreter (through the sandbox).

Call syntax inside an action: ``<call>NAME ARGUMENT</call>``, e.g. ``<call>calc 12*3</call>`` or
``<call>python print(12*3)</call>``. Only the first call of an action is executed.

A tool never raises on model input: it returns ``ToolResult(ok=False, output="error: …")``.
"""
from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass
from typing import Callable

from gearlab.envs import sandbox

__all__ = ["ToolResult", "parse_call", "calculator", "python_tool", "TOOLS", "call_tool"]

_CALL_RE = re.compile(r"<call>\s*([A-Za-z_]\w*)\s?(.*?)</call>", re.DOTALL)
MAX_EXPR_CHARS = 200
MAX_ABS = 10**15  # results beyond this are an error, not a 10^4300-digit string


@dataclass(frozen=True)
class ToolResult:
    ok: bool
    output: str


def parse_call(action: str) -> tuple[str, str] | None:
    """(tool name, argument text) of the first ``<call>…</call>`` in ``action``, or None."""
    m = _CALL_RE.search(action)
    return (m.group(1), m.group(2).strip()) if m else None


_BINOPS: dict[type, Callable] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                                 ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Div: operator.truediv}
_UNOPS: dict[type, Callable] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if abs(node.value) > MAX_ABS:
            raise OverflowError("number too large")
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _eval(node.left), _eval(node.right)
        out = _BINOPS[type(node.op)](a, b)
        if abs(out) > MAX_ABS:
            raise OverflowError("result too large")
        return out
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
        return _UNOPS[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculator(expr: str) -> ToolResult:
    """Evaluate an arithmetic expression: numbers, + - * / // %, unary minus, parentheses (usual
    precedence). No names, calls, powers or attribute access; at most 200 characters; |values| ≤ 1e15.
    Integral results print as integers ("36", not "36.0")."""
    if len(expr) > MAX_EXPR_CHARS:
        return ToolResult(False, f"error: expression longer than {MAX_EXPR_CHARS} characters")
    try:
        value = _eval(ast.parse(expr.strip(), mode="eval"))
    except ZeroDivisionError:
        return ToolResult(False, "error: division by zero")
    except (SyntaxError, ValueError, OverflowError, TypeError, RecursionError) as e:
        return ToolResult(False, f"error: {type(e).__name__}: {e}"[:200])
    if isinstance(value, float):
        value = int(value) if value.is_integer() else round(value, 6)
    return ToolResult(True, str(value))


def python_tool(code: str, *, timeout_s: float = 2.0, memory_mb: int = 256) -> ToolResult:
    """Run ``code`` in :func:`gearlab.envs.sandbox.run`; the output is its stdout (≤ 500 chars), or
    "error: …" with the last line of the error."""
    res = sandbox.run(code, timeout_s=timeout_s, memory_mb=memory_mb)
    if res.ok:
        return ToolResult(True, res.stdout.strip()[:500])
    last = (res.error or res.stderr or "failed").strip().splitlines()
    return ToolResult(False, "error: " + (last[-1] if last else "failed")[:200])


TOOLS: dict[str, Callable[[str], ToolResult]] = {"calc": calculator, "python": python_tool}


def call_tool(name: str, arg: str, allowed: tuple[str, ...] | None = None) -> ToolResult:
    """Run tool ``name`` on ``arg``; an unknown (or not allowed) tool is an error result."""
    if name not in TOOLS or (allowed is not None and name not in allowed):
        return ToolResult(False, f"error: unknown tool {name!r}")
    return TOOLS[name](arg)
