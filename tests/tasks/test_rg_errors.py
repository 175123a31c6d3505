"""Error location for reasoning-gym completions (gearlab/tasks/rg_errors.py).

Hand-written completions with planted errors on real generated entries (fixed seeds), the dataset's own
worked solutions as a no-false-blame sweep, and the documented edge cases.
"""
from __future__ import annotations

import ast
from fractions import Fraction

import pytest

from gearlab.tasks.rg_errors import SUPPORTED, locate_arith_error, locate_gsm_error

rg = pytest.importorskip("reasoning_gym")


def _blamed(span: tuple[int, int] | None, completion: str) -> str | None:
    """The text of the located span (checked to be a valid, non-empty span of the completion)."""
    if span is None:
        return None
    s, e = span
    assert isinstance(s, int) and isinstance(e, int) and 0 <= s < e <= len(completion), span
    return completion[s:e]


def _gsm(entry: dict, completion: str, **kw) -> str | None:
    return _blamed(locate_gsm_error(entry, completion, **kw), completion)


def _arith(dataset: str, entry: dict, completion: str, **kw) -> str | None:
    return _blamed(locate_arith_error(dataset, entry, completion, **kw), completion)


def _entry(dataset: str, seed: int, index: int = 0) -> dict:
    return rg.create_dataset(dataset, seed=seed, size=index + 1)[index]


# ----------------------------------------------------------------------------------------- gsm_symbolic
@pytest.fixture(scope="module")
def kiwi() -> dict:
    """3 times as much kiwi as apple; 35 apple; bought 93 apple and 38 fewer kiwi than that. Answer 288."""
    e = _entry("gsm_symbolic", seed=1)
    assert e["answer"] == "288" and "35 apple" in e["question"] and "38 fewer kiwi" in e["question"]
    return e


GOOD = (
    "John has 35 apples and 3 times as many kiwis, so 35 × 3 = 105 kiwis.\n"
    "Total at first: 105 + 35 = 140\n"
    "He bought 93 - 38 = 55 kiwis.\n"
    "Total kiwi: 105 + 55 = 160\n"
    "Total apple: 35 + 93 = 128\n"
    "Combined: 160 + 128 = 288\n"
)


def test_gsm_correct_solutions_are_none(kiwi):
    assert locate_gsm_error(kiwi, GOOD + "<answer>288</answer>") is None
    assert locate_gsm_error(kiwi, "<answer>288</answer>") is None  # the outcome is what counts
    assert locate_gsm_error(kiwi, GOOD.replace("= 160", "= 161") + "<answer>288</answer>") is None
    assert locate_gsm_error(kiwi, GOOD + "<answer>I think 288 items</answer>") is None  # scorer: first number
    cot = kiwi["metadata"]["answer_cot"] + "\n<answer>288</answer>"
    assert locate_gsm_error(kiwi, cot) is None


@pytest.mark.parametrize("completion, wrong", [
    # misread quantity: 36 is neither in the problem nor a result
    ("John has 36 apples and 3 times as many kiwis, so 36 × 3 = 108 kiwis.\nTotal at first: 108 + 36 = 144\n"
     "<answer>292</answer>", "John has 36 apples and 3 times as many kiwis, so 36 × 3 = 108 kiwis."),
    ("Kiwi: 35 × 3 = 105\nBought kiwi: 93 - 37 = 56\n<answer>289</answer>", "Bought kiwi: 93 - 37 = 56"),
    # miscomputation
    ("so 35 × 3 = 115 kiwi\n115 + 35 = 150\n<answer>298</answer>", "so 35 × 3 = 115 kiwi"),
    # a later miscomputation (the earlier lines are right)
    (GOOD.replace("160 + 128 = 288", "160 + 128 = 278") + "<answer>278</answer>", "Combined: 160 + 128 = 278"),
    ("35 x 4 = 105\n", "35 x 4 = 105"),  # "x" between numbers multiplies
    # dropped step: 55 is used without being derived (it is neither in the problem nor a result)
    ("35 × 3 = 105 kiwi\nTotal kiwi: 105 + 55 = 160\nTotal apple: 35 + 93 = 128\n160 + 128 = 278\n<answer>278</answer>",
     "Total kiwi: 105 + 55 = 160"),
    # a carried result misread (106 was never stated)
    ("35 × 3 = 105\n106 + 35 = 141\n<answer>289</answer>", "106 + 35 = 141"),
    # a chain of equalities: checked segment by segment
    ("35 × 3 + 35 = 105 + 35 = 150\n<answer>298</answer>", "35 × 3 + 35 = 105 + 35 = 150"),
    ("  Total: 35 × 3 = 105 + 35 = 140 = 141\n<answer>289</answer>", "  Total: 35 × 3 = 105 + 35 = 140 = 141"),
])
def test_gsm_planted_errors(kiwi, completion, wrong):
    assert _gsm(kiwi, completion) == wrong


def test_gsm_correct_chain_wrong_answer_is_blamed_at_the_answer(kiwi):
    assert _gsm(kiwi, GOOD + "<answer>287</answer>") == "<answer>287</answer>"
    assert _gsm(kiwi, GOOD + "So the answer is <answer>\n287\n</answer>.") == "<answer>\n287\n</answer>"
    # dropped step with a correct-looking chain (the kiwi bought are forgotten): nothing to blame but the answer
    c = "35 × 3 = 105\n105 + 35 = 140\n140 + 93 = 233\n<answer>233</answer>"
    assert _gsm(kiwi, c) == "<answer>233</answer>"
    # the last answer tag counts (an earlier one is text like any other); lines after it are not read
    c = GOOD + "<answer>288</answer>\n<answer>287</answer>"
    assert _gsm(kiwi, c) == "<answer>287</answer>"
    c = GOOD + "<answer>288</answer>\n35 × 3 = 115\n<answer>287</answer>"
    assert _gsm(kiwi, c) == "35 × 3 = 115"
    assert _gsm(kiwi, GOOD + "<answer>287</answer>\n35 × 3 = 115") == "<answer>287</answer>"
    # correct=False (the task's verdict) overrides the scorer; correct=True gives None
    assert _gsm(kiwi, GOOD + "<answer>288</answer>", correct=False) == "<answer>288</answer>"
    assert locate_gsm_error(kiwi, GOOD + "<answer>287</answer>", correct=True) is None


def test_gsm_exact_positions(kiwi):
    c = "35 × 3 = 105\n105 + 35 = 141\n<answer>289</answer>"
    assert locate_gsm_error(kiwi, c) == (13, 27)
    assert locate_gsm_error(kiwi, c.replace("\n", "\r\n")) == (14, 28)  # the "\r" is excluded
    assert locate_gsm_error(kiwi, "\n\n35 × 3 = 115\n") == (2, 14)
    c = GOOD + "<answer>287</answer>"
    assert locate_gsm_error(kiwi, c) == (len(GOOD), len(c))


def test_gsm_no_answer_garbage_and_empty(kiwi):
    # no answer tag (reward 0): after correct lines, the last non-blank line
    assert _gsm(kiwi, GOOD + "\n  \n") == "Combined: 160 + 128 = 288"
    assert _gsm(kiwi, "I do not know.\nMaybe ask John.\n\n") == "Maybe ask John."
    assert _gsm(kiwi, "blah blah <answer>lots</answer>") == "<answer>lots</answer>"
    assert _gsm(kiwi, "So 35 × 3 = 115, I guess") == "So 35 × 3 = 115, I guess"  # a wrong step first
    assert locate_gsm_error(kiwi, "") is None  # nothing to point at
    assert locate_gsm_error(kiwi, " \n ") == (0, 3)  # whitespace only: the whole completion


def test_gsm_prose_and_formats(kiwi):
    # not computations: a bare restatement, a variable, "of"
    c = "kiwi = 105\nx = 7\n3% of 35 = 1\n35 × 3 = 105\n<answer>287</answer>"
    assert _gsm(kiwi, c) == "<answer>287</answer>"
    # a result stated in prose, one operation from the problem's quantities, may be used (55 = 93 - 38)
    c = "He bought 55 kiwis at the store.\nTotal kiwi: 105 + 55 = 160\n<answer>287</answer>"
    assert _gsm(kiwi, c) == "Total kiwi: 105 + 55 = 160"  # ... but 105 is not: 35 x 3 was never written
    c = "He bought 55 kiwis and had 105 at home.\nTotal kiwi: 105 + 55 = 160\n<answer>287</answer>"
    assert _gsm(kiwi, c) == "<answer>287</answer>"
    # units, words and currency around the numbers are dropped
    c = "35 apples/day × 3 days = 105 apples.\n105 kiwi + 35 apple = 140 items\n<answer>287</answer>"
    assert _gsm(kiwi, c) == "<answer>287</answer>"


def test_gsm_numbers_in_many_formats():
    entry = {
        "question": "A house costs $410,000. The fee is 8% of the price and 1.5 times the tax. "
                    "The seller got a discount of -2. What is it? ",
        "answer": "32800",
        "metadata": {"variables": "{'price': 410000, 'fee_percent': 8, 'ratio': Fraction(3, 2)}"},
    }
    ok = "The fee is $410,000 x 8% = $32,800.\n"
    c = ok + "<answer>32,800</answer>"  # the scorer reads "32": wrong, blamed at the answer
    assert _gsm(entry, c) == "<answer>32,800</answer>"
    assert locate_gsm_error(entry, ok + "<answer>$32800.</answer>") is None
    assert _gsm(entry, "The fee is $410,000 x 8% = $32,900.\n<answer>32900</answer>") == (
        "The fee is $410,000 x 8% = $32,900.")
    assert _gsm(entry, "410,000 × 0.08 = 32,800\n32,800 × 1.5 = 49,200\n-2 × 1.5 = -3\n<answer>1</answer>") == (
        "<answer>1</answer>")  # 0.08 = 8/100, 1.5 in the question, a negative number
    assert _gsm(entry, "410,000 × 0.09 = 36,900\n<answer>1</answer>") == "410,000 × 0.09 = 36,900"
    assert _gsm(entry, "410000 / 3 = 136666.67\n<answer>1</answer>") == "<answer>1</answer>"  # stated rounding
    assert _gsm(entry, "410000 / 3 = 136666.6\n<answer>1</answer>") == "<answer>1</answer>"  # relative 1e-6
    assert _gsm(entry, "410000 / 3 = 136660.6\n<answer>1</answer>") == "410000 / 3 = 136660.6"
    assert _gsm(entry, "410000 / 3 = 136666\n<answer>1</answer>") == "<answer>1</answer>"  # a count: floor
    assert _gsm(entry, "410000 / 3 = 136660\n<answer>1</answer>") == "410000 / 3 = 136660"
    assert _gsm(entry, "410000 / 0 = 5\n<answer>1</answer>") == "410000 / 0 = 5"  # division by zero


def test_gsm_variables_as_dict_or_string():
    entry = _entry("gsm_symbolic", seed=191)  # beads: "24*0.25=6" uses 1 - fraction_dropped (0.75)
    cot = entry["metadata"]["answer_cot"] + "\n<answer>0</answer>"
    assert "24*0.25=6" in cot and "0.75" not in entry["question"] and "0.25" not in entry["question"]
    blamed = "<answer>0</answer>"
    assert _gsm(entry, cot) == blamed
    as_string = dict(entry, metadata=dict(entry["metadata"], variables=repr(entry["metadata"]["variables"])))
    assert _gsm(as_string, cot) == blamed
    no_variables = dict(entry, metadata={})
    assert _gsm(no_variables, cot) == "Robert dropped his beads and was left with 24*0.25=6 beads."


def test_gsm_never_raises():
    assert locate_gsm_error({}, "1 + 1 = 3\n<answer>2</answer>") is None  # no oracle answer
    assert locate_gsm_error({"answer": "2"}, None) is None  # type: ignore[arg-type]
    odd = {"question": None, "answer": "2", "metadata": {"variables": "{not python"}}
    assert _gsm(odd, "1 + 1 = 3\n<answer>3</answer>") == "1 + 1 = 3"  # 1 is a constant; the arithmetic is wrong
    huge = "9" * 5000 + " + 5 = 1\n" + "= = ( ) 1/0 % x ÷\x00\ufffd\n" + "1+" * 3000 + "1 = 2\n<answer>7</answer>"
    assert _gsm({"question": "", "answer": "2"}, huge) == "<answer>7</answer>"


def test_gsm_no_false_blame_on_the_dataset_worked_solutions():
    """The dataset's own solution (``answer_cot``) of 300 entries: no line is ever blamed."""
    for seed in range(300):
        e = _entry("gsm_symbolic", seed=seed)
        c = e["metadata"]["answer_cot"] + "\n<answer>" + e["answer"] + "</answer>"
        assert locate_gsm_error(e, c) is None, seed
        # a wrong outcome with the same lines: only the answer can be blamed
        assert _gsm(e, c, correct=False) == "<answer>" + e["answer"] + "</answer>", (seed, e["metadata"])


# ------------------------------------------------------------------------------ arithmetic datasets
def test_supported():
    assert SUPPORTED == {"gsm_symbolic", "basic_arithmetic", "chain_sum", "products"}
    assert locate_arith_error("leg_counting", {"answer": "4"}, "1 + 1 = 3\n<answer>3</answer>") is None
    assert locate_arith_error("gsm_symbolic", {"answer": "4"}, "1 + 1 = 3\n<answer>3</answer>") is None


@pytest.fixture(scope="module")
def chain() -> dict:
    e = _entry("chain_sum", seed=1, index=2)
    assert e["metadata"]["expression"] == "57 + 87 + 70" and e["answer"] == "214"
    return e


@pytest.mark.parametrize("completion, wrong", [
    ("57 + 87 = 144\n144 + 70 = 214\n<answer>214</answer>", None),
    ("57 + 87 + 70 = 214\n<answer>214.00</answer>", None),  # the scorer compares Decimals
    ("<answer>+214</answer>", None),
    ("57 + 87 = 144\n144 + 70 = 214\n<answer>241</answer>", "<answer>241</answer>"),  # wrong final answer
    ("57 + 78 = 135\n135 + 70 = 205\n<answer>205</answer>", "57 + 78 = 135"),  # misread operand
    ("57 + 87 = 134\n134 + 70 = 204\n<answer>204</answer>", "57 + 87 = 134"),  # miscomputation
    ("57 + 87 = 144\n145 + 70 = 215\n<answer>215</answer>", "145 + 70 = 215"),  # wrong carry
    ("57 + 87 = 144\n144 + 71 = 215\n<answer>215</answer>", "144 + 71 = 215"),
    ("57 + 87 = 144\n<answer>144</answer>", "<answer>144</answer>"),  # dropped step: blamed at the answer
    ("57 + 87 = 144\n144 + 70 = 214", "144 + 70 = 214"),  # no answer tag: the last non-blank line
    ("First, 50 + 80 = 130 and 7 + 7 = 14; then 130 + 14 = 144.\n144 + 70 = 214 I think\n<answer>2140</answer>",
     "<answer>2140</answer>"),  # place-value parts of the operands are quantities
    ("50 + 80 = 130\n130 + 9 = 139\n<answer>209</answer>", "130 + 9 = 139"),  # 9 is no part of 57, 87 or 70
])
def test_chain_sum(chain, completion, wrong):
    assert _arith("chain_sum", chain, completion) == wrong


@pytest.fixture(scope="module")
def basic() -> dict:
    e = _entry("basic_arithmetic", seed=1, index=2)
    assert e["metadata"]["expression"] == "( 56 + -33 ) - 84" and e["answer"] == "-61"
    return e


@pytest.mark.parametrize("completion, wrong", [
    ("56 + -33 = 23\n23 - 84 = -61\n<answer>-61</answer>", None),
    ("56 - 33 = 23\n23 - 84 = −61\n<answer>-61</answer>", None),  # a minus sign "−" in a line is "-"
    ("56 - 33 = 23\n23 - 84 = −61\n<answer>−61</answer>", "<answer>−61</answer>"),  # ... not to the scorer
    ("56 + -33 = 23\n23 - 84 = -61\n<answer>-61.0</answer>", "<answer>-61.0</answer>"),  # exact string scorer
    ("(56 + -33) - 84 = -61\n<answer>61</answer>", "<answer>61</answer>"),
    ("56 + -33 = 22\n22 - 84 = -62\n<answer>-62</answer>", "56 + -33 = 22"),  # miscomputation
    ("56 + -33 = 23\n23 - 84 = 61\n<answer>61</answer>", "23 - 84 = 61"),  # sign lost in the result
    ("56 + -38 = 18\n18 - 84 = -66\n<answer>-66</answer>", "56 + -38 = 18"),  # misread
    # documented limit: provenance compares absolute values, so an operand's sign slip is not a misread;
    # here every line is right arithmetic, so the answer is blamed
    ("56 + 33 = 89\n89 - 84 = 5\n<answer>5</answer>", "<answer>5</answer>"),
])
def test_basic_arithmetic(basic, completion, wrong):
    assert _arith("basic_arithmetic", basic, completion) == wrong


def test_basic_arithmetic_divides_with_floor():
    entry = {"question": "Calculate 7 / 2 + -1.", "answer": "2", "metadata": {"expression": "7 / 2 + -1"}}
    assert _arith("basic_arithmetic", entry, "7 / 2 = 3\n3 + -1 = 2\n<answer>2</answer>") is None
    assert _arith("basic_arithmetic", entry, "7 / 2 = 3\n3 - 1 = 2", correct=False) == "3 - 1 = 2"
    assert _arith("basic_arithmetic", entry, "7 / 2 = 3.5\n3.5 - 1 = 2.5\n<answer>2.5</answer>") == "7 / 2 = 3.5"
    assert _arith("basic_arithmetic", entry, "-7 / 2 = -4\n<answer>-4</answer>") == "<answer>-4</answer>"


@pytest.fixture(scope="module")
def product() -> dict:
    e = _entry("products", seed=1)
    assert e["metadata"]["expression"] == "18271 * 43432" and e["answer"] == "793546072"
    return e


LONG = (
    "18271 × 2 = 36542\n"
    "18271 × 30 = 548130\n"
    "18271 × 400 = 7308400\n"
    "18271 × 3000 = 54813000\n"
    "18271 × 40000 = 730840000\n"
    "36542 + 548130 + 7308400 + 54813000 + 730840000 = 793546072\n"
)


@pytest.mark.parametrize("completion, wrong", [
    ("18271 * 43432 = 793546072\n<answer>793546072</answer>", None),
    ("<answer>793,546,072</answer>", None),  # commas stripped by the scorer
    (LONG + "<answer>793546072</answer>", None),
    (LONG + "<answer>793546702</answer>", "<answer>793546702</answer>"),  # wrong final answer
    (LONG.replace("548130", "548310") + "<answer>793546252</answer>", "18271 × 30 = 548310"),  # partial product
    (LONG.replace("18271 × 400", "18721 × 400").replace("7308400", "7488400") + "<answer>1</answer>",
     "18721 × 400 = 7488400"),  # misread operand
    (LONG.replace("× 3000", "× 5000").replace("54813000", "91355000") + "<answer>1</answer>",
     "18271 × 5000 = 91355000"),  # 5000 is no part of 43432
    ("18271 × 43432 = 18271 × 40000 + 18271 × 3432 = 730840000 + 62706072 = 793546072\n<answer>1</answer>",
     "<answer>1</answer>"),  # an equality chain: inline partial products are checked by the arithmetic
    ("18271 × 43432 = 18271 × 40000 + 18271 × 3432 = 730840000 + 62706027 = 793546027\n<answer>793546027</answer>",
     "18271 × 43432 = 18271 × 40000 + 18271 × 3432 = 730840000 + 62706027 = 793546027"),
    ("18,271 × 43,432 = 793,546,072.\n<answer>1</answer>", "<answer>1</answer>"),
])
def test_products(product, completion, wrong):
    assert _arith("products", product, completion) == wrong


def test_arith_exact_positions_and_edge_cases(chain):
    c = "57 + 87 = 144\n144 + 70 = 215\n<answer>215</answer>"
    assert locate_arith_error("chain_sum", chain, c) == (14, 28)
    assert locate_arith_error("chain_sum", chain, "") is None
    assert locate_arith_error("chain_sum", chain, "\n\t\n") == (0, 3)
    assert locate_arith_error("chain_sum", chain, None) is None  # type: ignore[arg-type]
    assert locate_arith_error("chain_sum", {}, c) is None  # no oracle answer: cannot tell
    assert _arith("chain_sum", {"answer": "214"}, c) == "57 + 87 = 144"  # no operands known


_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def _worked(expression: str, floor: bool) -> tuple[list[str], Fraction]:
    """One line "a op b = v" per operation of `expression`, innermost first (Python precedence)."""
    lines: list[str] = []

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant):
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp):
            return -ev(node.operand)
        a, b, op = ev(node.left), ev(node.right), _OPS[type(node.op)]
        if op == "/":
            v = Fraction(a // b) if floor else a / b
        else:
            v = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(f"{a} {op} {b} = {v}")
        return v

    return lines, ev(ast.parse(expression, mode="eval").body)


@pytest.mark.parametrize("dataset", ["chain_sum", "basic_arithmetic", "products"])
def test_arith_no_false_blame_on_worked_solutions(dataset):
    for e in rg.create_dataset(dataset, seed=7, size=200):
        lines, value = _worked(e["metadata"]["expression"], floor=dataset == "basic_arithmetic")
        assert str(value) == e["answer"]
        c = "\n".join(lines) + f"\n<answer>{e['answer']}</answer>"
        assert locate_arith_error(dataset, e, c) is None
        assert _arith(dataset, e, c, correct=False) == f"<answer>{e['answer']}</answer>", e["question"]
