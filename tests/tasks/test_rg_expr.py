"""The arithmetic of a reasoning line (gearlab.tasks.rg_expr): exact values of what a completion wrote."""
from __future__ import annotations

from fractions import Fraction

import pytest

from gearlab.tasks.rg_expr import is_expr, parse, tokens


@pytest.mark.parametrize("text,value", [
    ("2(98+57)", 310),  # a number against "(" multiplies it
    ("14÷2/3", 21),  # a tight fraction is one quantity: 14 ÷ (2/3)
    ("1,234 + 30%", Fraction(12343, 10)),  # thousands separator; "%" is /100
    ("£195/day * 12 days", 2340),  # currency, unit suffix and words dropped
    ("6 x 0.5 − 1", 2),  # "x" multiplies; the minus sign subtracts
    ("- 5 + 3", 8),  # a leading "- " is a list bullet, not a sign
    ("-(2 - 7) * 3", 15),  # unary minus and precedence
])
def test_the_exact_value_of_a_line(text, value):
    assert parse(tokens(text)) == value


def test_floor_division_and_division_by_zero():
    assert parse(tokens("7 / 2")) == Fraction(7, 2)
    assert parse(tokens("7 / 2"), floor_div=True) == 3  # basic_arithmetic's answers
    with pytest.raises(ZeroDivisionError):
        parse(tokens("4 / (2 - 2)"))
    assert is_expr(tokens("4 / (2 - 2)"))  # wrong, but an expression


def test_what_is_not_one_expression():
    assert parse(tokens("3 + 4 = 7")) is None  # "=" ends an expression
    assert parse(tokens("(3 + 4")) is None and parse([]) is None
    assert tokens("1" * 101) == [("brk",)]  # too long to be a quantity
    num = tokens("30%")[0]
    assert num == ("num", Fraction(3, 10), Fraction(30), 0, False)  # value, as written, decimals, exempt
    assert tokens("1/12")[1][4] is True  # a proper fraction up to twelfths is exempt from provenance
