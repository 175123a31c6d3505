"""Embedded multi-turn tool task: arithmetic chains solved by calling a calculator (or Python).

A problem is an arithmetic chain evaluated left to right (as ``arith``) with operands large enough
that a tiny model cannot do it in its head (default 2 steps, operands 10–99). The intended episode:

    user:       Compute 37*52-18 left to right with calc.
    assistant:  <call>calc 37*52</call>          tool: 1924
    assistant:  <call>calc 1924-18</call>        tool: 1906
    assistant:  Answer: 1906

Rewards (environment: :class:`ToolArithEnv`)
  turn reward   ``valid_reward`` for a call that parses and runs (only for the first ``num_steps``
                calls, so calling forever earns nothing) + ``step_reward`` when the call's result is
                the NEXT value of the left-to-right trace (progress); 0 for the final answer turn.
  outcome       1 if the final "Answer: N" equals the ground truth, else 0 (also 0 when the episode
                is cut by the turn or token budget before an answer).
An action with no call and no "Answer:" ends the episode (outcome 0).

``tools="calc"`` (default) or ``"python"`` or ``"calc,python"``: which tools are allowed; the prompt
names them and the demonstrations use them (alternating by problem when both). Python calls run
through :func:`gearlab.envs.sandbox.run` (a process each, ~tens of ms).
"""
from __future__ import annotations

import hashlib

from gearlab.envs.base import Environment, StepResult
from gearlab.envs.tools import call_tool, parse_call
from gearlab.tasks.arithmetic import ArithmeticTask, evaluate_chain
from gearlab.tasks.base import Problem
from gearlab.tasks.registry import register_task

__all__ = ["ToolArithTask", "ToolArithEnv"]


class ToolArithEnv(Environment):
    def __init__(self, task: "ToolArithTask", problem: Problem) -> None:
        self.task, self.problem = task, problem
        ops, operands = problem.meta["ops"], problem.meta["operands"]
        self.trace = [str(v) for v in evaluate_chain(operands, ops)]
        self.progress = 0
        self.calls = 0
        self.answer: str | None = None

    def reset(self) -> str:
        return self.problem.prompt

    def step(self, action: str) -> StepResult:
        call = parse_call(action)
        if call is not None:
            self.calls += 1
            res = call_tool(call[0], call[1], allowed=self.task.tools)
            correct = res.ok and self.progress < len(self.trace) and res.output == self.trace[self.progress]
            self.progress += bool(correct)
            reward = self.task.valid_reward * (res.ok and self.calls <= len(self.trace)) + self.task.step_reward * correct
            info = {"tool_call": True, "valid_call": res.ok, "correct": bool(correct),
                    "anchor": f"{self.progress}:{res.output}"}
            return StepResult(res.output, float(reward), False, info)
        self.answer = self.task.extract_answer(action)
        return StepResult("", 0.0, True, {"tool_call": False, "finished": self.answer is not None})

    def outcome(self) -> float:
        return 1.0 if self.answer is not None and self.answer == self.task.normalize_answer(self.problem.answer) else 0.0


@register_task("tool_arith")
class ToolArithTask(ArithmeticTask):
    """Multi-turn arithmetic with tools. Options as ``ArithmeticTask`` plus ``tools``, ``valid_reward``,
    ``step_reward`` and ``max_turns`` (default num_steps + 2: every step, the answer, one spare)."""

    multi_turn = True
    name = "tool_arith"

    def __init__(self, num_steps: int = 2, max_operand: int = 99, ops: str = "+-*", seed: int = 0,
                 min_operand: int = 10, test_fraction: float = 0.2, tools: str = "calc",
                 valid_reward: float = 0.1, step_reward: float = 0.2, max_turns: int | None = None) -> None:
        super().__init__(num_steps=num_steps, max_operand=max_operand, ops=ops, seed=seed, min_operand=min_operand,
                         test_fraction=test_fraction)
        names = tuple(t.strip() for t in tools.split(",") if t.strip())
        if not names or any(t not in ("calc", "python") for t in names):
            raise ValueError(f"tools must be 'calc', 'python' or 'calc,python', got {tools!r}")
        self.tools = names
        self.valid_reward, self.step_reward = float(valid_reward), float(step_reward)
        self.max_turns = max_turns if max_turns is not None else num_steps + 2

    def make_problem(self, operands: list[int], ops: list[str]) -> Problem:
        p = super().make_problem(operands, ops)
        tools = " or ".join(self.tools)
        # the compact expression ("88+33*7"), as the calls spell it: the first call copies a span of the prompt
        return Problem(prompt=f"Compute {p.meta['expr']} left to right with {tools}.",
                       answer=p.answer, solution=p.solution, meta=p.meta)

    def make_env(self, problem: Problem) -> ToolArithEnv:
        return ToolArithEnv(self, problem)

    def demo_actions(self, problem: Problem) -> list[str]:
        ops, operands = problem.meta["ops"], problem.meta["operands"]
        tool = self.tools[0]
        if len(self.tools) > 1:  # alternate deterministically by problem
            tool = self.tools[hashlib.sha256(problem.prompt.encode()).digest()[0] % len(self.tools)]
        acts, left = [], operands[0]
        for op, b, res in zip(ops, operands[1:], evaluate_chain(operands, ops)):
            expr = f"{left}{op}{b}"
            acts.append(f"<call>calc {expr}</call>" if tool == "calc" else f"<call>python print({expr})</call>")
            left = res
        return acts + [f"Answer: {problem.answer}"]

    def __repr__(self) -> str:
        return (f"ToolArithTask(num_steps={self.num_steps}, operands={self.min_operand}..{self.max_operand}, "
                f"ops={self.ops!r}, tools={','.join(self.tools)})")
