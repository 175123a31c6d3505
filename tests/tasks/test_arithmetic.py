"""Arithmetic task: determinism, split disjointness, reward, solutions, jsonl loading."""
from __future__ import annotations

import json

import pytest

from gearlab.tasks.arithmetic import ArithmeticTask, evaluate_chain
from gearlab.tasks.registry import TASKS, get_task
from gearlab.tasks.base import Problem, load_jsonl_problems


def test_problems_are_deterministic_and_seed_dependent():
    task = ArithmeticTask()
    a = task.problems("train", 50, seed=3)
    b = ArithmeticTask().problems("train", 50, seed=3)
    c = task.problems("train", 50, seed=4)
    assert a == b
    assert [p.prompt for p in a] != [p.prompt for p in c]


def test_train_and_test_are_disjoint_for_all_seeds():
    task = ArithmeticTask()
    train = {p.meta["expr"] for s in range(3) for p in task.problems("train", 1000, seed=s)}
    test = {p.meta["expr"] for s in range(3) for p in task.problems("test", 300, seed=s)}
    assert train and test and not (train & test)
    # small test sets hold distinct problems
    assert len({p.prompt for p in task.problems("test", 200, seed=0)}) == 200


def test_left_to_right_solution_and_format():
    task = ArithmeticTask()
    p = task.make_problem([7, 5, 3], ["+", "*"])
    assert p.prompt == "Compute 7 + 5 * 3 left to right."
    assert p.answer == "36"  # (7+5)*3, not 7+(5*3)
    assert p.solution == "7+5=12\n12*3=36\nAnswer: 36"
    assert evaluate_chain([3, 8, 4], ["-", "*"]) == [-5, -20]
    assert task.make_problem([3, 8, 4], ["-", "*"]).solution == "3-8=-5\n-5*4=-20\nAnswer: -20"


@pytest.mark.parametrize("name", ["arith", "arith_hard"])
def test_every_solution_verifies(name):
    task = get_task(name)
    for p in task.problems("train", 100, seed=0) + task.problems("test", 100, seed=0):
        assert task.reward(p, p.solution) == 1.0
        assert task.extract_answer(p.solution) == p.answer
        steps = p.solution.splitlines()[:-1]
        assert len(steps) == task.num_steps


def test_reward_correct_incorrect_garbage():
    task = ArithmeticTask()
    p = task.make_problem([9, 1, 7], ["-", "+"])  # 15
    assert task.reward(p, "9-1=8\n8+7=15\nAnswer: 15") == 1.0
    assert task.reward(p, "Answer: 015") == 1.0  # normalised integer
    assert task.reward(p, "Answer: 3\nAnswer: 15") == 1.0  # last "Answer:" wins
    assert task.reward(p, "Answer: 15\nAnswer: 3") == 0.0
    assert task.reward(p, "9-1=8\n8+7=16\nAnswer: 16") == 0.0
    assert task.reward(p, "Answer: 150") == 0.0
    assert task.reward(p, "Answer: -15") == 0.0
    for junk in ["", "15", "Answer:", "Answer: x", "\x00\ufffd<|im_end|>", "Answer: " + "9" * 5000]:
        assert task.reward(p, junk) == 0.0
    assert task.reward(p, None) == 0.0  # type: ignore[arg-type]
    neg = task.make_problem([1, 7, 4], ["-", "*"])
    assert task.reward(neg, "Answer: -24") == 1.0


def test_messages_plain_and_privileged():
    task = ArithmeticTask()
    p = task.make_problem([7, 5, 3], ["+", "*"])
    plain = task.messages(p)
    priv = task.messages(p, privileged=True)
    assert plain == [{"role": "user", "content": p.prompt}]
    assert priv[-1]["role"] == "user"
    assert priv[-1]["content"].startswith(p.prompt) and "Reference answer: 36" in priv[-1]["content"]


def test_registry():
    assert "arith" in TASKS and "arith_hard" in TASKS
    hard = get_task("arith_hard")
    assert hard.name == "arith_hard" and hard.num_steps > 2 and hard.max_operand > 9
    assert get_task("arith", num_steps=3).num_steps == 3
    with pytest.raises(KeyError, match="arith"):
        get_task("no_such_task")


def test_jsonl_loader(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(
        json.dumps({"prompt": "1+1?", "answer": 2, "solution": "Answer: 2", "id": 7}) + "\n\n"
        + json.dumps({"prompt": "2+2?", "answer": "4"}) + "\n"
    )
    probs = load_jsonl_problems(good)
    assert probs[0] == Problem("1+1?", "2", "Answer: 2")
    assert probs[0].meta == {"id": 7}
    assert probs[1].solution == ""

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    with pytest.raises(ValueError) as e:
        load_jsonl_problems(bad)
    assert str(e.value) == f"{bad}:2: row has no 'answer'"

    noprompt = tmp_path / "noprompt.jsonl"
    noprompt.write_text(json.dumps({"answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"noprompt\.jsonl:1: row has no 'prompt'"):
        load_jsonl_problems(noprompt)
