"""Error location for reasoning-gym completions: the span of the first wrong step of a failed completion.

A reasoning-gym task (``task=rg``) passes the reasoning-gym entry
(``question``, ``answer``, ``metadata``) and the completion. Contract as in
:meth:`gearlab.tasks.base.Task.locate_error`: a span ``(start, end)`` in the completion's coordinates,
never empty; None when the outcome is correct or when it cannot tell; never raises.

Completions are free-form reasoning lines and a final answer in tags (``... <answer>288</answer>``; the
LAST ``<answer>...</answer>`` is the answer, as ``reasoning_gym.utils.extract_answer`` reads it).

The walk (both :func:`locate_gsm_error` and :func:`locate_arith_error`): the non-blank lines before the
final answer tag are read in order, and every EQUATION CHAIN of a line is checked. A chain is
``E0 = E1 = ... = En``, each segment an arithmetic expression over numbers with ``+ - * / × x ÷ ( )``
(``%`` reads as /100) or a bare number, at least one segment with an operator (``48=48`` and ``x = 5``
are not computations). Prose is ignored: words, currency signs and unit suffixes ("/day") are dropped,
so "£195/day * 12 days/month = £2340/month" is the chain ``195 * 12 = 2340``; E0 is the longest
expression ending at the first "=" (numbers left side by side, without an operator between them,
delimit it, as does punctuation other than a thousands separator or a decimal point). Numbers may be
negative, decimals, "1,234", "$5", "30%", followed by units or a period. A chain is wrong when

* (arithmetic) two consecutive segments differ in value: two integers at all, otherwise beyond a
  relative 1e-6 (float noise, as in ``6 x 0.6666666666666666 = 4.0``) and beyond the rounding a bare
  decimal states ("10/3 = 3.33"); or a division by zero. gsm_symbolic also accepts an integer stated
  within 1 of a non-integral value;
* (provenance) a number written in the chain's first segment with an operator is not an allowed
  operand: a quantity of the problem, an earlier result, or a dataset-specific constant (rules in the
  two functions; compared by absolute value: a sign is an operator). The other numbers of the chain
  are results, checked by the arithmetic.

A line that passes makes known ("earlier results"): every number of its chains (and each ``%`` value);
any number right after an "=" (a stated result, also where the chain cannot be checked: the "141" of
"70 + 47 + 24 + T = 141 + T"); and a number elsewhere in it (prose, "The first 2 complexes have 600
apartments") that is one operation (+ - * /) away from two quantities of the problem or earlier results.

The error is the first line with a wrong chain: the whole line, its "\\n" (and a "\\r" before it)
excluded, as in :mod:`gearlab.tasks.arithmetic`. If no line is wrong, the final answer is blamed: the
span of the last ``<answer>...</answer>`` (tags included), or, with no answer tag, the last non-blank line
(the chain stopped there). No non-blank line at all: the whole completion when it is whitespace, None when
it is empty. A correct outcome (the dataset's reward would be 1.0) gives None, whatever the lines say.
Lines after the final answer tag are not read (the answer, wrong, comes first).
"""
from __future__ import annotations

import ast
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from numbers import Rational, Real

from gearlab.tasks.base import line_spans
from gearlab.tasks.rg_expr import is_expr, parse, tokens

__all__ = ["SUPPORTED", "locate_arith_error", "locate_gsm_error"]

ARITH_DATASETS = frozenset({"basic_arithmetic", "chain_sum", "products"})
SUPPORTED = frozenset({"gsm_symbolic"}) | ARITH_DATASETS

# Same pattern as reasoning_gym.utils.extract_answer (the last match is the answer).
_ANSWER_RE = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
# gsm_symbolic's scorer reads the first number of the answer and compares floats.
_GSM_SCORE_RE = re.compile(r"\b-?\d+(?:\.\d+)?\b")
# gsm_symbolic constants: 1 (complements "1 - 0.25", "one"), 2 (half/twice/double/pair), 10 and 100
# (tenths, percentages "8/100", cents).
_GSM_CONSTANTS = frozenset(Fraction(n) for n in (1, 2, 10, 100))
# Number words (and unit words implying a factor) in the question: their values are quantities of it.
_WORD_VALUES = {
    "one": (1,), "two": (2,), "three": (3,), "four": (4,), "five": (5,), "six": (6,), "seven": (7,),
    "eight": (8,), "nine": (9,), "ten": (10,), "eleven": (11,), "twelve": (12,), "twenty": (20,),
    "thirty": (30,), "forty": (40,), "fifty": (50,), "hundred": (100,), "thousand": (1000,),
    "half": (2, Fraction(1, 2)), "twice": (2,), "double": (2,), "pair": (2,), "triple": (3,), "thrice": (3,),
    "third": (3, Fraction(1, 3)), "quarter": (4, Fraction(1, 4)), "dozen": (12,), "dozens": (12,),
    "week": (7,), "weeks": (7,), "weekly": (7,), "month": (4, 12, 30), "months": (4, 12, 30),
    "year": (12, 52, 365), "years": (12, 52, 365), "hour": (60,), "hours": (60, 24), "minute": (60,),
    "minutes": (60,), "day": (24,), "days": (24,),
    "foot": (12,), "feet": (12,), "inches": (12,), "yard": (3,), "yards": (3,), "cents": (100,), "percent": (100,),
}

_COUNT_WORDS = frozenset(  # a count word before a number multiplies it: "two 3-hour episodes" (6 hours)
    "one two three four five six seven eight nine ten eleven twelve twenty thirty forty fifty".split()
)
_TOLERANCE = Fraction(1, 10**6)  # arithmetic: relative tolerance between the two sides
_NOISE = Fraction(1, 10**9)  # provenance: relative tolerance to a known quantity (float print noise)
_WINDOW = 64  # tokens: the longest expression looked for (chain_sum's 12 terms are 23 tokens)



def locate_gsm_error(entry: dict, completion: str, *, correct: bool | None = None) -> tuple[int, int] | None:
    """Span of the first wrong step of a failed gsm_symbolic completion, or None (module docstring rules).

    Quantities of the problem: the numbers written with digits in the question; the values of
    ``metadata["variables"]`` (a dict, or its string repr; they include the generator's derived values,
    e.g. an intermediate total: stating a correct intermediate without deriving it is not an error); and
    the values of number/unit words in the question (:data:`_WORD_VALUES`: "dozen" 12, "week" 7, "twice"
    2, "yard" 3, ...). Besides those and earlier results, allowed operands are the constants 1, 2, 10, 100,
    percentages of known numbers both ways (n/100, n*100) and complements (1 - f for 0 < f < 1,
    100 - p and (100 - p)/100 for 0 < p < 100: "had 5% left" spends 0.95). Arithmetic also accepts an
    integer stated for a non-integral value within 1 (floor, ceiling or nearest: a count of items, as the
    dataset's own solutions write "13*0.5=6").

    Outcome: ``correct`` (the task's own verdict, ``reward == 1.0``) when given; otherwise computed like
    reasoning-gym's scorer (first number of the answer, compared as a float with ``entry["answer"]``).
    """
    try:
        if correct is None:
            correct = _gsm_correct(_final_answer(completion), entry["answer"])
        meta = entry.get("metadata") or {}
        base = _numbers_in(str(entry.get("question", ""))) | _word_values(entry.get("question"))
        base |= _variable_values(meta.get("variables"))
        return _locate(completion, correct, _Quantities(base, _GSM_CONSTANTS, _gsm_derived, rounding=True))
    except Exception:  # never raise on odd text or odd entries
        return None


def locate_arith_error(
    dataset: str, entry: dict, completion: str, *, correct: bool | None = None
) -> tuple[int, int] | None:
    """Span of the first wrong step of a failed completion of an arithmetic dataset, or None.

    Supported: ``basic_arithmetic``, ``chain_sum``, ``products`` (:data:`ARITH_DATASETS`); None for any
    other dataset (``gsm_symbolic`` has :func:`locate_gsm_error`). Rules in the module docstring.

    Quantities of the problem: its operands (``metadata["expression"]``, else the question) and their
    place-value parts (an operand with some digits zeroed: 43432 -> 40000, 3000, 432, 43400, ... — the
    pieces of a long multiplication or a column addition). No constants, no rounding. In
    basic_arithmetic "/" is floor division, as the dataset computes its answers (Python ``//``): "7 / 2 = 3"
    is right there and "7 / 2 = 3.5" wrong (the dataset's answer follows the floor). Outcome:
    ``correct`` when given, otherwise like reasoning-gym's scorers: chain_sum and products compare
    Decimals (commas stripped), basic_arithmetic compares strings exactly.
    """
    try:
        if dataset not in ARITH_DATASETS:
            return None
        if correct is None:
            correct = _arith_correct(dataset, _final_answer(completion), str(entry["answer"]))
        source = (entry.get("metadata") or {}).get("expression") or entry.get("question", "")
        base: set[Fraction] = set()
        for n in _numbers_in(str(source)):
            base |= _place_parts(n)
        q = _Quantities(base, frozenset(), lambda n: (), rounding=False, floor_div=dataset == "basic_arithmetic")
        return _locate(completion, correct, q)
    except Exception:  # never raise on odd text or odd entries
        return None


class _Quantities:
    """What a completion may use as an operand, growing as its lines are read.

    `base` holds the problem's quantities and the results and derived numbers learnt so far (the
    operands of the one-operation rule); `known` adds the constants and `derived(n)` of every base n.
    """

    def __init__(
        self, base: set[Fraction], constants: frozenset, derived, rounding: bool, floor_div: bool = False
    ) -> None:
        self.base: set[Fraction] = set()
        self.known: set[Fraction] = set(constants)
        self.derived = derived
        self.rounding = rounding
        self.floor_div = floor_div
        for n in base:
            self.learn(n)

    def learn(self, n: Fraction) -> None:
        n = abs(n)
        if n not in self.base:
            self.base.add(n)
            self.known.add(n)
            self.known.update(self.derived(n))

    def allowed(self, n: Fraction) -> bool:
        """n is known, up to a relative 1e-9 (a float printed with noise: 6.749999999999999 for 6.75)."""
        n = abs(n)
        return n in self.known or any(abs(n - k) <= _NOISE * max(n, k) for k in self.known)

    def derivable(self, n: Fraction) -> bool:
        """n is one operation (+ - * /) away from two base quantities (a result stated in prose)."""
        n = abs(n)
        for a in self.base:
            if n + a in self.base or abs(n - a) in self.base:
                return True
            if a and (n / a in self.base or n * a in self.base):
                return True
        return False


def _locate(completion: str, correct: bool, q: _Quantities) -> tuple[int, int] | None:
    """The shared walk (module docstring)."""
    if not isinstance(completion, str) or correct:
        return None
    lines = [(s, e) for s, e in line_spans(completion) if completion[s:e].strip()]
    if not lines:
        return (0, len(completion)) if completion else None
    tags = list(_ANSWER_RE.finditer(completion))
    cutoff = tags[-1].start() if tags else len(completion)
    for s, e in lines:
        if s >= cutoff:
            break
        if not _check_line(completion[s:min(e, cutoff)], q):
            return s, e
    return tags[-1].span() if tags else lines[-1]


def _check_line(line: str, q: _Quantities) -> bool:
    """False if an equation chain of the line is wrong; otherwise learns what the line states.

    What is learnt: module docstring. Chains are checked left to right (a chain's results are known to
    the chains after it); prose numbers are learnt before the chains and again after them.
    """
    toks = tokens(line)
    chains: list[list[list[tuple]]] = []
    i, bound = 0, 0
    while i < len(toks):
        chain, end = _chain(toks, bound, i) if toks[i][0] == "eq" else (None, i + 1)
        if chain is not None:
            chains.append(chain)
            bound = end
        i = end
    in_chains = {id(t) for chain in chains for seg in chain for t in seg}
    prose = [t for t in toks if t[0] == "num" and id(t) not in in_chains]
    for stage in ("before", *chains, "after"):
        if isinstance(stage, str):
            for t in prose:
                if q.derivable(t[2]):
                    q.learn(t[2])
            continue
        if not _chain_ok(stage, q):
            return False
        for t in (t for seg in stage for t in seg if t[0] == "num"):
            q.learn(t[1])
            q.learn(t[2])
    for prev, t in zip(toks, toks[1:]):
        if prev[0] == "eq" and t[0] == "num":
            q.learn(t[2])
    return True


def _chain(toks: list[tuple], bound: int, eq: int) -> tuple[list[list[tuple]] | None, int]:
    """The chain whose first "=" is toks[eq]: its segments (token lists) and the index after it.

    E0 is the longest parseable run ending just before the "=" and starting at or after `bound`; each
    following segment is the longest parseable run after an "=". None when E0 or E1 is missing or when no
    segment has an operator. Runs are searched within _WINDOW tokens (bounded work on odd text); a run
    the window may have cut (it would go on past the window) ends the chain before it (None if it is E0).
    """
    start = bound
    for j in range(eq - 1, bound - 1, -1):
        if toks[j][0] in ("eq", "brk"):
            start = j + 1
            break
    lo = max(start, eq - _WINDOW)
    first = next((j for j in range(lo, eq) if is_expr(toks[j:eq])), None)
    if first is None or (lo > start and toks[first - 1][0] in ("op", "lp")):
        return None, eq + 1  # none, or one the window may have cut
    segs, pos = [toks[first:eq]], eq
    while pos < len(toks) and toks[pos][0] == "eq":
        stop = next((k for k in range(pos + 1, len(toks)) if toks[k][0] in ("eq", "brk")), len(toks))
        hi = min(stop, pos + 1 + _WINDOW)
        seg = next((toks[pos + 1:k] for k in range(hi, pos + 1, -1) if is_expr(toks[pos + 1:k])), None)
        if seg is None or (hi < stop and toks[pos + 1 + len(seg)][0] in ("op", "rp")):
            break
        segs.append(seg)
        pos += 1 + len(seg)
    if len(segs) < 2:
        return None, eq + 1
    if not any(t[0] == "op" for s in segs for t in s):
        return None, pos  # "a = b = c": no part of it is a computation
    return segs, pos


def _chain_ok(chain: list[list[tuple]], q: _Quantities) -> bool:
    """Arithmetic (consecutive segments agree) and provenance (operands of the first computed segment)."""
    computed = next(seg for seg in chain if any(t[0] == "op" for t in seg))
    if any(t[0] == "num" and not t[4] and not q.allowed(t[2]) for t in computed):
        return False
    try:
        values = [parse(seg, q.floor_div) for seg in chain]
    except ZeroDivisionError:
        return False
    pairs = zip(values, chain, values[1:], chain[1:])
    return all(_agree(a, sa, b, sb, q.rounding) for a, sa, b, sb in pairs)


def _agree(a: Fraction, seg_a: list[tuple], b: Fraction, seg_b: list[tuple], rounding: bool) -> bool:
    """Equal values: exactly (always, when both are integers), up to a relative 1e-6, up to the rounding a
    bare decimal number states, or (`rounding`) a bare integer within 1 of a non-integral value."""
    if a == b:
        return True
    if a.denominator == b.denominator == 1:
        return False  # 730840000 + 62706027 is not 793546072, however close
    if abs(a - b) <= _TOLERANCE * max(abs(a), abs(b)):
        return True
    for seg, other in ((seg_a, b), (seg_b, a)):
        if len(seg) == 1 and seg[0][0] == "num":
            stated, decimals = seg[0][1], seg[0][3]
            if decimals and abs(stated - other) <= Fraction(1, 2 * 10**decimals):
                return True
            if rounding and not decimals and other.denominator != 1 and abs(stated - other) < 1:
                return True
    return False


def _final_answer(completion: str) -> str | None:
    """Content of the last ``<answer>...</answer>`` (stripped), as reasoning-gym extracts it; None if none."""
    tags = list(_ANSWER_RE.finditer(completion))
    return tags[-1].group(1).strip() if tags else None


def _gsm_correct(answer: str | None, oracle) -> bool:
    """gsm_symbolic's scorer gives 1.0: the answer's first number equals the oracle as floats."""
    m = _GSM_SCORE_RE.search(answer) if answer else None
    return m is not None and float(m.group(0)) == float(oracle)


def _arith_correct(dataset: str, answer: str | None, oracle: str) -> bool:
    """The dataset's scorer gives 1.0 (basic_arithmetic: exact string; others: equal Decimals, commas stripped)."""
    if not answer:
        return False
    if dataset == "basic_arithmetic":
        return answer == oracle
    try:
        return Decimal(answer.replace(",", "")) == Decimal(oracle.replace(",", ""))
    except (InvalidOperation, ValueError):
        return False


def _numbers_in(text: str) -> set[Fraction]:
    """Absolute values of the numbers written with digits in `text` (thousands separators allowed)."""
    return {abs(t[2]) for t in tokens(text) if t[0] == "num"}


def _word_values(question) -> set[Fraction]:
    """Values of the number and unit words of the question (:data:`_WORD_VALUES`), and the total of a
    counted quantity: a number word before a number ("two 3-hour episodes" -> 6)."""
    text = str(question or "").lower()
    out = {Fraction(v) for w in re.findall(r"[a-z]+", text) for v in _WORD_VALUES.get(w, ())}
    for word, number in re.findall(r"\b([a-z]+)\s+(\d+(?:\.\d+)?)(?![\d,])", text):
        if word in _COUNT_WORDS:
            out.add(_WORD_VALUES[word][0] * Fraction(number))
    return out


def _variable_values(variables) -> set[Fraction]:
    """Numeric values in gsm_symbolic's ``metadata["variables"]`` (dict, list, or their string repr)."""
    if isinstance(variables, str):
        try:
            variables = ast.literal_eval(variables)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return _numbers_in(variables)  # e.g. "Fraction(2, 1)" inside: take the written numbers
    out: set[Fraction] = set()
    stack = [variables]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set)):
            stack.extend(v)
        elif isinstance(v, bool):
            continue
        elif isinstance(v, Rational):
            out.add(abs(Fraction(v)))
        elif isinstance(v, Real):
            out.add(abs(Fraction(repr(float(v)))))  # as written: 0.1 -> 1/10, not the binary float
    return out


def _gsm_derived(n: Fraction) -> tuple[Fraction, ...]:
    """Quantities a known n makes known in gsm_symbolic: percentages both ways and complements."""
    out = [n / 100, n * 100]
    if 0 < n < 1:
        out.append(1 - n)
    if 0 < n < 100:
        out.extend((100 - n, (100 - n) / 100))
    return tuple(out)


def _place_parts(n: Fraction) -> set[Fraction]:
    """n and its place-value parts: n with some digits zeroed (43432 -> 40000, 3000, 432, 43030, ...).

    An integer of more than 6 digits gives its zero-filled runs of digits only (1234567 -> 1230000, 4500,
    567, ...), to keep the set small; a non-integer gives itself.
    """
    if n.denominator != 1:
        return {n}
    digits = str(n.numerator)
    k = len(digits)
    out = {n}
    if k <= 6:
        for mask in range(1, 2**k):
            out.add(Fraction(int("".join(d if mask >> (k - 1 - i) & 1 else "0" for i, d in enumerate(digits)))))
        return out
    for a in range(k):
        for b in range(a + 1, k + 1):
            out.add(Fraction(int(digits[a:b] + "0" * (k - b))))
    return out
