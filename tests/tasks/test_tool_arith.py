"""The embedded multi-turn tool task: its environment's turn rewards and outcome."""
from __future__ import annotations

import pytest

from gearlab.tasks.registry import get_task


@pytest.fixture
def task():
    return get_task("tool_arith")


def test_problems_and_prompt(task):
    p = task.problems("train", 1, seed=3)[0]
    assert task.multi_turn and task.max_turns == 4
    assert p.prompt == f"Compute {p.meta['expr']} left to right with calc."
    assert all(10 <= x <= 99 for x in p.meta["operands"])
    assert {q.prompt for q in task.problems("train", 50)}.isdisjoint({q.prompt for q in task.problems("test", 50)})


def test_demonstration_earns_every_reward(task):
    for p in task.problems("train", 5, seed=1):
        env = task.make_env(p)
        assert env.reset() == p.prompt
        rewards = [env.step(a).reward for a in task.demo_actions(p)]
        assert rewards == pytest.approx([0.3, 0.3, 0.0]) and env.outcome() == 1.0


def test_turn_rewards_of_wrong_and_odd_actions(task):
    p = task.make_problem([12, 3, 5], ["*", "+"])  # 12*3=36, 36+5=41
    env = task.make_env(p)
    env.reset()
    r = env.step("<call>calc 12+3</call>")  # valid, not the next trace value
    assert (r.observation, r.reward, r.done, r.info["correct"]) == ("15", pytest.approx(0.1), False, False)
    r = env.step("<call>calc 12*</call>")  # does not parse: no reward, the error is shown
    assert r.reward == 0.0 and r.observation.startswith("error:") and not r.info["valid_call"]
    r = env.step("<call>calc 12*3</call>")  # progress; the 3rd call of a 2-step chain earns no validity reward
    assert r.reward == pytest.approx(0.2) and r.info["correct"] and r.info["anchor"] == "1:36"
    r = env.step("Answer: 41")
    assert r.done and r.info["finished"] and env.outcome() == 1.0
    env = task.make_env(p)
    env.reset()
    r = env.step("I give up")
    assert r.done and not r.info["finished"] and env.outcome() == 0.0


def test_python_tool_variant(task):
    t = get_task("tool_arith", tools="python")
    p = t.make_problem([12, 3, 5], ["*", "+"])
    assert t.demo_actions(p) == ["<call>python print(12*3)</call>", "<call>python print(36+5)</call>", "Answer: 41"]
    env = t.make_env(p)
    env.reset()
    assert env.step("<call>calc 12*3</call>").observation == "error: unknown tool 'calc'"  # not allowed here
    env = t.make_env(p)
    env.reset()
    assert [env.step(a).reward for a in t.demo_actions(p)] == pytest.approx([0.3, 0.3, 0.0]) and env.outcome() == 1.0
    with pytest.raises(ValueError, match="tools must be"):
        get_task("tool_arith", tools="shell")


def test_single_turn_tasks_have_no_environment():
    with pytest.raises(NotImplementedError, match="single-turn"):
        get_task("arith").make_env(None)
