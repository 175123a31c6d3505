"""Worked solutions computed for reasoning-gym's arithmetic datasets (gearlab.tasks.rg_steps)."""
import pytest

from gearlab.tasks.rg import ReasoningGymTask
from gearlab.tasks.rg_errors import locate_arith_error
from gearlab.tasks.rg_steps import worked_solution


def _entry(expression: str, answer) -> dict:
    return {"question": f"Calculate {expression}.", "answer": str(answer), "metadata": {"expression": expression}}


@pytest.mark.parametrize("dataset, expression, answer, lines", [
    ("chain_sum", "4 - 1 - 7", -4, ["4 - 1 = 3", "3 - 7 = -4"]),
    # precedence first, then left to right; a negative operand keeps its sign
    ("basic_arithmetic", "-9 + 5 - -1 * -4 + -2 * 2", -12,
     ["-9 + 5 = -4", "-1 * -4 = 4", "-4 - 4 = -8", "-2 * 2 = -4", "-8 + -4 = -12"]),
    # parentheses; the negation of a computed value is folded into the next operand, with no line of its own
    ("basic_arithmetic", "-( 4 + -2 ) * 3", -6, ["4 + -2 = 2", "-2 * 3 = -6"]),
    # basic_arithmetic's "/" is floor division, as the dataset computes its answers
    ("basic_arithmetic", "7 / 2 + 1", 4, ["7 / 2 = 3", "3 + 1 = 4"]),
    ("products", "18271 * 43432", 793546072, ["18271 * 43432 = 793546072"]),
])
def test_one_line_per_operation_in_evaluation_order(dataset, expression, answer, lines):
    assert worked_solution(dataset, _entry(expression, answer)) == lines


@pytest.mark.parametrize("dataset, expression, answer", [
    ("chain_sum", "4 - 1 - 7", -5),          # not the entry's answer: no demonstration rather than a wrong one
    ("products", "7 / 2", 3.5),              # a value that is not an integer (true division outside basic_arithmetic)
    ("chain_sum", "4 +", 4),                 # does not parse
    ("gsm_symbolic", "4 - 1", 3),            # not an arithmetic dataset
])
def test_no_solution_where_it_could_be_wrong(dataset, expression, answer):
    assert worked_solution(dataset, _entry(expression, answer)) is None


@pytest.mark.parametrize("dataset", ["chain_sum", "basic_arithmetic", "products"])
def test_demonstrations_score_1_and_every_line_passes_the_error_checker(dataset):
    task = ReasoningGymTask(dataset, system_prompt="none")
    problems = task.problems("train", 200, seed=3)
    steps = 0
    for p in problems:
        assert task.reward(p, p.solution) == 1.0, p.solution
        # told the outcome is wrong, the checker finds no wrong line and blames the answer tag
        start, end = locate_arith_error(dataset, p.meta["entry"], p.solution, correct=False)
        assert p.solution[start:end] == f"<answer>{p.answer}</answer>"
        steps += p.solution.count("\n")
    assert steps >= len(problems)  # at least one computation line each


def test_a_planted_miscomputation_in_a_demonstration_is_located():
    entry = _entry("4 - 1 - 7", -4)
    wrong = "4 - 1 = 2\n2 - 7 = -5\n<answer>-5</answer>"
    assert locate_arith_error("chain_sum", entry, wrong) == (0, len("4 - 1 = 2"))


def test_the_tiny_model_preset_is_chain_sum_of_three_or_four_one_digit_terms():
    from gearlab.config import load_config
    from gearlab.tasks.registry import task_from_config

    task = task_from_config(load_config(["task=rg_chain_sum"]))
    problems = task.problems("test", 50, seed=0)
    assert task.system_prompt is None  # no system turn
    for p in problems:
        terms = p.meta["entry"]["metadata"]["expression"].split()[::2]
        assert 3 <= len(terms) <= 4 and all(len(t) == 1 for t in terms), p.prompt
        assert p.solution.count("\n") == len(terms) - 1  # one line per operation, then the answer line
