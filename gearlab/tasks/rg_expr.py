"""The arithmetic of one line of free-form reasoning, for :mod:`gearlab.tasks.rg_errors`: its tokens (numbers as
written, with "%", thousands separators, tight fractions and dropped words / units) and the exact value of a run of
them read as one expression (``fractions.Fraction``: no float rounding)."""
from __future__ import annotations

import re
from fractions import Fraction

_MINUS = "-\u2212\u2013"  # hyphen, minus sign, en dash
_TOKEN_RE = re.compile(
    r"(?P<frac>(?<![\d/.,])(?P<fnum>\d{1,12})/(?P<fden>\d{1,12})(?![\d/]|\.\d))"
    r"|(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?P<pct>\s?%)?"
    r"|(?P<unit>/\s*[A-Za-z]+)"
    r"|(?P<op>[-+*/×÷·\u2212\u2013]|(?<![A-Za-z])[xX](?![A-Za-z]))"
    r"|(?P<lp>\()|(?P<rp>\))|(?P<eq>=)"
    r"|(?P<skip>[A-Za-z_']+|[$£€¥₹\s])"
    r"|(?P<brk>.)"
)
_BULLET_RE = re.compile(r"^\s*[-*+]\s")
_MAX_DIGITS = 100  # a longer "number" is not a quantity (and keeps Fraction/int conversions cheap)


def tokens(line: str) -> list[tuple]:
    """Tokens: ("num", value, written, decimals, exempt), ("op", c), ("lp",), ("rp",), ("eq",), ("brk",).

    A number's value applies its "%" (/100); `written` is the number as written (the provenance key).
    Words, currency signs, spaces and unit suffixes ("/day") are dropped; a leading "- " / "* " / "+ "
    is a list bullet (dropped); a number written against "(" multiplies it ("2(98+57)"). A fraction
    written tight, "2/3", is one quantity: parenthesised, so "14÷2/3" is 14 ÷ (2/3); a proper one with a
    denominator up to 12 (halves ... twelfths: "1/12" of an hour) is `exempt` from provenance.
    """
    out: list[tuple] = []
    line = _BULLET_RE.sub(lambda m: " " * len(m[0]), line, count=1)
    num_end = -1
    for m in _TOKEN_RE.finditer(line):
        if m["lp"] and m.start() == num_end:
            out.append(("op", "*"))  # "2(98+57)": a number written against "(" multiplies it
        num_end = m.end() if m["num"] else -1
        if m["frac"]:
            p, d = int(m["fnum"]), int(m["fden"])
            exempt = 0 < p < d <= 12
            a, b = (("num", Fraction(x), Fraction(x), 0, exempt) for x in (p, d))
            out.extend([("lp",), a, ("op", "/"), b, ("rp",)])
        elif m["num"]:
            text = m["num"].replace(",", "")
            if len(text) > _MAX_DIGITS:
                out.append(("brk",))
                continue
            written = Fraction(text)
            decimals = len(text.split(".")[1]) if "." in text else 0
            out.append(("num", written / 100 if m["pct"] else written, written, decimals, False))
        elif m["op"]:
            c = m["op"]
            out.append(("op", "-" if c in _MINUS else "*" if c in "×xX·" else "/" if c == "÷" else c))
        elif m["lp"] or m["rp"] or m["eq"] or m["brk"]:
            out.append((m.lastgroup,))
    return out


def is_expr(toks: list[tuple]) -> bool:
    """`toks` is one whole expression (a division by zero included: it is wrong, not unparseable)."""
    try:
        return parse(toks) is not None
    except ZeroDivisionError:
        return True


def parse(toks: list[tuple], floor_div: bool = False) -> Fraction | None:
    """Value of `toks` as one whole expression (precedence, parentheses, unary minus), or None.

    `floor_div`: "/" is floor division (basic_arithmetic computes its answers so). Raises ZeroDivisionError
    on a division by zero.
    """
    pos = 0

    def expr() -> Fraction | None:
        nonlocal pos
        v = term()
        while v is not None and pos < len(toks) and toks[pos] in (("op", "+"), ("op", "-")):
            op = toks[pos][1]
            pos += 1
            w = term()
            v = None if w is None else v + w if op == "+" else v - w
        return v

    def term() -> Fraction | None:
        nonlocal pos
        v = unary()
        while v is not None and pos < len(toks) and toks[pos] in (("op", "*"), ("op", "/")):
            op = toks[pos][1]
            pos += 1
            w = unary()
            v = None if w is None else v * w if op == "*" else Fraction(v // w) if floor_div else v / w
        return v

    def unary() -> Fraction | None:
        nonlocal pos
        if pos < len(toks) and toks[pos] == ("op", "-"):
            pos += 1
            v = unary()
            return None if v is None else -v
        if pos < len(toks) and toks[pos][0] == "num":
            pos += 1
            return toks[pos - 1][1]
        if pos < len(toks) and toks[pos][0] == "lp":
            pos += 1
            v = expr()
            if v is None or pos >= len(toks) or toks[pos][0] != "rp":
                return None
            pos += 1
            return v
        return None

    if not toks:
        return None
    value = expr()
    return value if pos == len(toks) else None
