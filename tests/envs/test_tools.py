"""Calculator and Python tools, and the call syntax."""
from __future__ import annotations

import pytest

from gearlab.envs.tools import call_tool, calculator, parse_call, python_tool


@pytest.mark.parametrize("expr,out", [("12*3", "36"), ("2+3*4", "14"), ("(2+3)*4", "20"), ("-9+45", "36"),
                                      ("7/2", "3.5"), ("8/2", "4"), ("7//2", "3"), ("7%3", "1"), (" 1 + 1 ", "2")])
def test_calculator_values(expr, out):
    r = calculator(expr)
    assert r.ok and r.output == out


@pytest.mark.parametrize("expr,why", [("__import__('os').system('id')", "unsupported"), ("2**10", "unsupported"),
                                      ("1/0", "division by zero"), ("abc", "unsupported"), ("1+", "SyntaxError"),
                                      ("9" * 30, "too large"), ("99999999*99999999*999", "too large"),
                                      ("1+" * 150 + "1", "longer than")])
def test_calculator_refuses(expr, why):
    r = calculator(expr)
    assert not r.ok and r.output.startswith("error:") and why in r.output


def test_parse_call():
    assert parse_call("thinking <call>calc 12*3</call> more") == ("calc", "12*3")
    assert parse_call("<call>python print(1)\nprint(2)</call>") == ("python", "print(1)\nprint(2)")
    assert parse_call("<call>calc 1+1") is None and parse_call("Answer: 3") is None
    assert parse_call("<call>calc 1</call><call>calc 2</call>") == ("calc", "1")  # only the first runs


def test_python_tool_through_the_sandbox():
    assert python_tool("print(94*79)").output == "7426"
    r = python_tool("raise ValueError('nope')")
    assert not r.ok and r.output == "error: ValueError: nope"
    r = python_tool("while True: pass", timeout_s=0.5)
    assert not r.ok and "time" in r.output.lower()


def test_unknown_or_disallowed_tool():
    assert call_tool("shell", "ls").output == "error: unknown tool 'shell'"
    assert not call_tool("python", "print(1)", allowed=("calc",)).ok
