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

Error location (:meth:`ToolArithTask.locate_error`) reads the episode transcript the multi-turn
engine records (``meta["texts"]``: every response token decoded with ``skip_special_tokens=False``):

    <call>calc 37*52</call><|im_end|>⏎<|im_start|>tool⏎1924<|im_end|>⏎<|im_start|>assistant⏎
    <call>calc 1924-18</call><|im_end|>⏎<|im_start|>tool⏎1906<|im_end|>⏎<|im_start|>assistant⏎
    Answer: 1906<|im_end|>

(one line here; ⏎ = newline). Policy actions are the text between the environment's tool turns —
``observation_text`` of gearlab.rollout.multiturn, a ChatML tool turn whatever the model's own chat
template — each ending with its end-of-turn token as the tokenizer spells it.
"""
from __future__ import annotations

import hashlib
import re

from gearlab.envs.base import Environment, StepResult
from gearlab.envs.tools import call_tool, parse_call
from gearlab.tasks.arithmetic import ArithmeticTask, evaluate_chain
from gearlab.tasks.base import Problem
from gearlab.tasks.registry import register_task

__all__ = ["ToolArithTask", "ToolArithEnv", "split_transcript"]

# The environment's turn as the multi-turn engine writes it (gearlab.rollout.multiturn.observation_text,
# spelled out here: tasks sit below rollout). The observation is the shortest text up to its closing markup.
_TOOL_TURN_RE = re.compile(r"\n<\|im_start\|>tool\n(.*?)<\|im_end\|>\n<\|im_start\|>assistant\n", re.DOTALL)
# An end-of-turn token at the very end of an action, as decoded with skip_special_tokens=False:
# ChatML / Llama-3 style "<|name|>" (<|im_end|>, <|endoftext|>, <|eot_id|>), or "</s>", "<eos>", "<end_of_turn>".
_END_OF_TURN_RE = re.compile(r"(?:<\|(?!im_start\|)[A-Za-z_][\w.-]{0,40}\|>|</s>|<eos>|<end_of_turn>)\Z")
# Special-token markup inside an action: the environment saw the action decoded WITHOUT special tokens.
_SPECIAL_RE = re.compile(r"<\|[A-Za-z_][\w.-]{0,40}\|>")


def split_transcript(text: str) -> list[tuple[int, int, bool, str | None]]:
    """The policy's actions in a multi-turn transcript: ``(start, end, ended, observation)`` per action.

    ``text[start:end]`` is the action as written, its end-of-turn token excluded; ``ended`` says whether
    the environment stepped it: that token is there, or a tool turn follows (False: the turn was cut — by
    the token budget or the per-turn limit — and the environment never saw it); ``observation`` is the environment's \
answer that follows it in
    the transcript, or None where none was appended (the episode ended there). Assumes the transcript
    layout of gearlab.rollout.multiturn (module docstring); text that is not in it reads as one action.
    """
    out: list[tuple[int, int, bool, str | None]] = []
    pos = 0
    while True:
        m = _TOOL_TURN_RE.search(text, pos)
        end = m.start() if m else len(text)
        eot = _END_OF_TURN_RE.search(text, pos, end)
        # an action followed by a tool turn was stepped, whatever its end-of-turn token looks like
        out.append((pos, eot.start() if eot else end, eot is not None or m is not None, m.group(1) if m else None))
        if m is None:
            return out
        pos = m.end()


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
            reward = self.task.valid_reward * (
                res.ok and self.calls <= len(self.trace)
            ) + self.task.step_reward * correct
            info = {"tool_call": True, "valid_call": res.ok, "correct": bool(correct),
                    "anchor": f"{self.progress}:{res.output}"}
            return StepResult(res.output, float(reward), False, info)
        self.answer = self.task.extract_answer(action)
        return StepResult("", 0.0, True, {"tool_call": False, "finished": self.answer is not None})

    def outcome(self) -> float:
        return 1.0 if self.answer is not None and self.answer == self.task.normalize_answer(
            self.problem.answer
        ) else 0.0


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

    def locate_error(self, problem: Problem, completion: str) -> tuple[int, int] | None:
        """Span of the first wrong policy ACTION of the episode transcript `completion` (see the module
        docstring for its layout and :meth:`Task.locate_error` for the contract).

        None when the outcome is correct (the episode's answer action states the right answer, whatever
        came before it). Otherwise the actions are judged in order as :class:`ToolArithEnv` judges them,
        and the first wrong one is blamed:

        * a tool call (``<call>…</call>``) that is invalid (does not parse or run) or whose result is not
          the NEXT value of the trace (no progress — an extra call after the chain is done included);
          the result is the tool's answer as the transcript shows it, or, where the episode ended before
          it was appended, the tool run again;
        * an action the environment never saw (cut before its end-of-turn token);
        * the answer action (no call), when all calls before it were right: its answer is wrong or
          missing (this includes answering before the chain is done).

        The span is the action's text only: not its end-of-turn token, not the tool's turn. None too
        when every action was a correct call and the episode then ended without an answer action (its
        budget ran out: nothing the policy wrote is wrong), or when the blamed action is empty.
        Special-token markup inside an action (``<|…|>``) is ignored when judging it, as the environment
        saw the action decoded without special tokens.
        """
        try:
            return self._locate_action_error(problem, completion)
        except Exception:  # never raise on odd text (or odd meta)
            return None

    def _locate_action_error(self, problem: Problem, completion: str) -> tuple[int, int] | None:
        if not isinstance(completion, str) or "operands" not in problem.meta or "ops" not in problem.meta:
            return None
        trace = [str(v) for v in evaluate_chain(list(problem.meta["operands"]), list(problem.meta["ops"]))]
        want = self.normalize_answer(problem.answer)
        actions = [(s, e, ended, obs, _SPECIAL_RE.sub("", completion[s:e]))
                   for s, e, ended, obs in split_transcript(completion)]
        for _, _, ended, _, act in actions:  # the environment stops at the first finished non-call action
            if ended and parse_call(act) is None:
                if self.extract_answer(act) == want:
                    return None
                break
        progress = 0
        for s, e, ended, obs, act in actions:
            call = parse_call(act) if ended else None
            if call is None:  # cut, or the answer action (wrong: a right one returned None above)
                return (s, e) if e > s else None
            result = obs if obs is not None else call_tool(call[0], call[1], allowed=self.tools).output
            if progress >= len(trace) or result.strip() != trace[progress]:
                return (s, e) if e > s else None
            progress += 1
        return None  # every action a correct call, then no answer action: the episode ran out

    def __repr__(self) -> str:
        return (f"ToolArithTask(num_steps={self.num_steps}, operands={self.min_operand}..{self.max_operand}, "
                f"ops={self.ops!r}, tools={','.join(self.tools)})")
