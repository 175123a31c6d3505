"""Ground truth for credit: ``Task.locate_error`` finds where a failed response first went wrong.

Arithmetic chains: hand-made completions with planted errors. Tool arithmetic: episode transcripts made by
the real multi-turn engine driven by a scripted policy (so the layout is the one training sees).
"""
from __future__ import annotations

import json

import pytest

from gearlab.rollout.base import SamplingParams
from gearlab.rollout.multiturn import MultiTurnRolloutEngine
from gearlab.tasks.base import Problem, Task
from gearlab.tasks.registry import get_task
from gearlab.tasks.tool_arith import split_transcript
from tests.rollout.scripted import ScriptedPolicy, action_ids


def _blamed(task: Task, problem: Problem, completion: str) -> str | None:
    """The text of the located span (checked to be a valid, non-empty span of the completion)."""
    span = task.locate_error(problem, completion)
    if span is None:
        return None
    s, e = span
    assert isinstance(s, int) and isinstance(e, int) and 0 <= s < e <= len(completion), span
    return completion[s:e]


# ---------------------------------------------------------------------------------------------- arith
@pytest.fixture
def arith():
    return get_task("arith")


@pytest.fixture
def p(arith):
    return arith.make_problem([7, 5, 3], ["+", "*"])  # 7+5=12, 12*3=36


@pytest.mark.parametrize("completion, wrong", [
    ("7+6=13\n13*3=39\nAnswer: 39", "7+6=13"),  # misread right operand (step 0)
    ("8+5=13\n13*3=39\nAnswer: 39", "8+5=13"),  # misread first operand
    ("7+5=12\n12*4=48\nAnswer: 48", "12*4=48"),  # misread right operand (step 1)
    ("7*5=35\n35*3=105\nAnswer: 105", "7*5=35"),  # wrong operator (step 0)
    ("7+5=12\n12+3=15\nAnswer: 15", "12+3=15"),  # wrong operator (step 1)
    ("7+5=12\n12*3=35\nAnswer: 35", "12*3=35"),  # miscomputation
    ("7+5=13\n13*3=39\nAnswer: 39", "7+5=13"),  # miscomputed, then a right carry of the wrong value: the first line
    ("7+5=12\n13*3=39\nAnswer: 39", "13*3=39"),  # wrong carry: continues from a value the previous line did not state
    ("7+5=12\nhmm, let me see\n12*3=36\nAnswer: 35", "hmm, let me see"),  # garbage where a step is expected
    ("Let's go.\n7+5=12\n12*3=36\nAnswer: 35", "Let's go."),
    ("7+5=12\n12*3=", "12*3="),  # a truncated step
    ("7+5=12\nAnswer: 12", "Answer: 12"),  # too few steps before the answer line
    ("7+5=12", "7+5=12"),  # runs out with steps missing: the last line
    ("7+5=12\n\n \n", "7+5=12"),  # ... blank lines are never blamed
    ("7+5=12\n12*3=36\nAnswer: 35", "Answer: 35"),  # correct chain, wrong answer
    ("7+5=12\n12*3=36\nAnswer: thirty-six", "Answer: thirty-six"),  # answer line without a value
    ("7+5=12\n12*3=36\nso it is 36", "so it is 36"),  # missing answer line: the text after the last correct step
    ("7+5=12\n12*3=36\n36+1=37\nAnswer: 37", "36+1=37"),  # extra step with a wrong answer: the first extra line
    ("7+5=12\n12*3=36\nAnswer: 36\nAnswer: 35", "Answer: 35"),  # the last answer counts: the wrong one
    ("7 + 5 = 12\n12 *3= 35\nAnswer: 35", "12 *3= 35"),  # spaces allowed; the span is the whole line
])
def test_arith_planted_errors(arith, p, completion, wrong):
    assert arith.reward(p, completion) == 0.0
    assert _blamed(arith, p, completion) == wrong


@pytest.mark.parametrize("completion", [
    "7+5=12\n12*3=36\nAnswer: 36",  # the reference solution
    "7 + 5 = 12\n\n12 * 3 = 36\nAnswer: 036",
    "7+5=12\n12*3=36\n36+0=36\nAnswer: 36",  # extra steps, right answer
    "7+5=13\n13*3=36\nAnswer: 36",  # a wrong step, but the outcome is correct: correct = reward 1
    "Answer: 36",
])
def test_arith_correct_outcome_is_none(arith, p, completion):
    assert arith.reward(p, completion) == 1.0
    assert arith.locate_error(p, completion) is None


def test_arith_no_answer_after_a_correct_chain_is_none(arith, p):
    for c in ("7+5=12\n12*3=36", "7+5=12\n12*3=36\n\n  \n", ""):
        assert arith.reward(p, c) == 0.0 and arith.locate_error(p, c) is None
    assert arith.locate_error(p, " \n ") == (0, 3)  # whitespace only: the whole completion


def test_arith_exact_positions(arith, p):
    assert arith.locate_error(p, "7+5=12\n12*3=35\nAnswer: 35") == (7, 14)
    assert arith.locate_error(p, "\n\n7+5=13\n13*3=39\nAnswer: 39") == (2, 8)  # after leading blank lines
    assert arith.locate_error(p, "7+5=12\r\n12*3=35\r\nAnswer: 35") == (8, 15)  # "\r\n": the "\r" is excluded
    assert arith.locate_error(p, "7+5=12\n12*3=36\nAnswer: 35") == (15, 25)


def test_arith_hard_four_steps_and_negative_numbers():
    hard = get_task("arith_hard")
    q = hard.make_problem([3, 8, 4, 20, 2], ["-", "*", "+", "-"])  # 3-8=-5, -5*4=-20, -20+20=0, 0-2=-2
    assert q.solution == "3-8=-5\n-5*4=-20\n-20+20=0\n0-2=-2\nAnswer: -2"
    assert hard.locate_error(q, q.solution) is None
    assert _blamed(hard, q, "3-8=5\n5*4=20\n20+20=40\n40-2=38\nAnswer: 38") == "3-8=5"  # sign lost
    assert _blamed(hard, q, "3-8=-5\n-5*4=-20\n-20+20=0\n0-2=2\nAnswer: 2") == "0-2=2"  # the last step
    assert _blamed(hard, q, "3-8=-5\n-5*4=-20\n-20+20=0\n-2=-2\nAnswer: -3") == "-2=-2"  # not a step
    assert _blamed(hard, q, "3-8=-5\n5*4=20\n20+20=40\n40-2=38\nAnswer: 38") == "5*4=20"  # carry drops the sign
    assert _blamed(hard, q, "3 - 8 = -5\n-5 * 4 = -20\n-20 + 20 = 0\n0 - 2 = -2\nAnswer: -3") == "Answer: -3"
    assert _blamed(hard, q, "3-8=-5\n-5*4=-20\nAnswer: -20") == "Answer: -20"  # two steps of four
    assert _blamed(hard, q, "3-8=-5\n-5*4=-20\n-20-20=-40\n-40-2=-42\nAnswer: -42") == "-20-20=-40"  # op misread
    assert _blamed(hard, q, "3-8=-5\n-5*4=-20\n-20+20=0\n0--2=2\nAnswer: 2") == "0--2=2"  # operand -2 for 2


def test_arith_never_raises_on_odd_input(arith, p):
    assert arith.locate_error(p, None) is None  # type: ignore[arg-type]
    assert arith.locate_error(Problem("What?", "3"), "1+2=3\nAnswer: 4") is None  # no chain in meta
    odd = "9" * 5000 + "+5=1\n" + "\x00\ufffd" + "\nAnswer: " + "7" * 5000
    assert _blamed(arith, p, odd) == "9" * 5000 + "+5=1"


def test_other_tasks_cannot_tell(tmp_path):
    gsm = get_task("gsm8k", path="sample")
    q = gsm.problems("train", 1)[0]
    assert gsm.locate_error(q, "garbage\nAnswer: -1") is None
    f = tmp_path / "rows.jsonl"
    f.write_text(json.dumps({"prompt": "2+2?", "answer": "4"}) + "\n")
    jl = get_task("jsonl", train_path=str(f))
    assert jl.locate_error(jl.problems("train", 1)[0], "Answer: 5") is None


# ---------------------------------------------------------------------------------------------- tool_arith
SP = SamplingParams(max_new_tokens=40, greedy=True)


@pytest.fixture
def tool():
    return get_task("tool_arith")


@pytest.fixture
def tp(tool):
    return tool.make_problem([12, 3, 5], ["*", "+"])  # 12*3=36, 36+5=41


def _episode(tokenizer, task, problem, actions, *, max_turns=4, cut_last=False):
    """(transcript, outcome, end reason) of one episode of the real engine playing `actions` turn by turn.
    cut_last: the last action has no end-of-turn token (a turn cut at the token limit, never stepped)."""
    def script(text, turn):
        k = min(turn, len(actions) - 1)
        return action_ids(tokenizer, actions[k], stop=not (cut_last and k == len(actions) - 1))

    eng = MultiTurnRolloutEngine(tokenizer, task, max_turns=max_turns, max_total_tokens=1000, step_workers=1)
    rb = eng.generate(ScriptedPolicy(tokenizer, script), [problem], group_size=1, sampling=SP, seed=0)
    return rb.meta["texts"][0], float(rb.rewards[0]), rb.meta["end_reasons"][0]


@pytest.mark.parametrize("actions, wrong, nth", [
    (["<call>calc 12*3</call>", "<call>calc 36+</call>", "Answer: 40"], "<call>calc 36+</call>", 1),  # does not parse
    (["<call>shell ls</call>", "Answer: 40"], "<call>shell ls</call>", 0),  # unknown tool
    (["<call>calc 12+3</call>", "<call>calc 15+5</call>", "Answer: 20"], "<call>calc 12+3</call>", 0),  # no progress
    (["<call>calc 12*3</call>", "<call>calc 12*3</call>", "Answer: 36"], "<call>calc 12*3</call>", 1),  # repeated call
    (["<call>calc 12*3</call>", "<call>calc 36+5</call>", "Answer: 42"], "Answer: 42", 2),  # right calls, wrong answer
    (["<call>calc 12*3</call>", "<call>calc 36+5</call>", "I give up"], "I give up", 2),  # no answer
    (["<call>calc 12*3</call>", "Answer: 36"], "Answer: 36", 1),  # answered before the chain was done
    (["<call>calc 12*3</call>", "<call>calc 36+5</call>", "<call>calc 41+0</call>", "<call>calc 41</call>"],
     "<call>calc 41+0</call>", 2),  # an extra call after the chain (then the turn limit)
])
def test_tool_arith_first_wrong_action(tokenizer, tool, tp, actions, wrong, nth):
    text, outcome, _ = _episode(tokenizer, tool, tp, actions)
    assert outcome == 0.0
    span = tool.locate_error(tp, text)
    assert span is not None and text[span[0]:span[1]] == wrong
    acts = split_transcript(text)
    assert span == acts[nth][:2]  # exactly the nth policy action: not its end-of-turn token, not the tool turn
    assert "<|im_" not in wrong and "tool" not in text[span[0]:span[1]]


def test_tool_arith_correct_outcome_is_none(tokenizer, tool, tp):
    text, outcome, _ = _episode(tokenizer, tool, tp, tool.demo_actions(tp))
    assert outcome == 1.0 and text.count("<|im_start|>tool") == 2
    assert tool.locate_error(tp, text) is None
    # an invalid call on the way, but the outcome is correct: None
    acts = ["<call>calc 12*</call>", "<call>calc 12*3</call>", "<call>calc 36+5</call>", "Answer: 41"]
    text, outcome, _ = _episode(tokenizer, tool, tp, acts)
    assert outcome == 1.0 and tool.locate_error(tp, text) is None


def test_tool_arith_episode_ends_without_observation(tokenizer, tool, tp):
    """At the turn limit the last call's result is not in the transcript: the tool is run again to judge it."""
    text, outcome, end = _episode(
        tokenizer, tool, tp, ["<call>calc 12*3</call>", "<call>calc 36-5</call>"], max_turns=2
    )
    assert (outcome, end) == (0.0, "max_turns") and not text.endswith("assistant\n")
    assert _blamed(tool, tp, text) == "<call>calc 36-5</call>"
    text, outcome, end = _episode(
        tokenizer, tool, tp, ["<call>calc 12*3</call>", "<call>calc 36+5</call>"], max_turns=2
    )
    assert (outcome, end) == (0.0, "max_turns")
    assert tool.locate_error(tp, text) is None  # every action right; the episode ran out before the answer


def test_tool_arith_cut_turn_is_wrong(tokenizer, tool, tp):
    """A turn cut before its end-of-turn token was never stepped: it is the wrong action, even if it reads right."""
    text, outcome, end = _episode(tokenizer, tool, tp, ["<call>calc 12*3</call>", "<call>calc 36+5</call>",
                                  "Answer: 41"],
                                  cut_last=True)
    assert (outcome, end) == (0.0, "turn_length") and text.endswith("Answer: 41")
    assert _blamed(tool, tp, text) == "Answer: 41"


def test_tool_arith_hand_written_transcripts(tool, tp):
    """Other end-of-turn spellings; the python tool judged from the transcript's observation (nothing is run)."""
    py = get_task("tool_arith", tools="python")
    obs = lambda o: f"\n<|im_start|>tool\n{o}<|im_end|>\n<|im_start|>assistant\n"  # noqa: E731
    t = ("<call>python print(12*3)</call><|eot_id|>" + obs("36") + "<call>python print(36+6)</call><|eot_id|>"
         + obs("42") + "Answer: 42<|eot_id|>")
    s = py.locate_error(tp, t)
    assert t[s[0]:s[1]] == "<call>python print(36+6)</call>"
    assert py.locate_error(tp, t.replace("36+6", "36+5").replace("42", "41")) is None
    # an action with special-token markup inside is judged as the environment saw it (markup removed)
    t2 = "<call>calc 12*3</call>" + "<|im_end|>" + obs(
        "36"
    ) + "<call>calc 36<|endoftext|>+5</call><|im_end|>" + obs("41") \
        + "Answer: 40<|im_end|>"
    assert _blamed(tool, tp, t2) == "Answer: 40"
    for odd in ("", "<|im_end|>", obs("36"), None):  # nothing written by the policy: nothing to point at
        assert tool.locate_error(tp, odd) is None  # type: ignore[arg-type]
    assert tool.locate_error(tp, "\x00" * 10) == (0, 10)  # one garbage action, cut (no end-of-turn token)
    assert tool.locate_error(Problem("?", "1"), t2) is None  # no chain in meta


def test_split_transcript_layout():
    t = "a<|im_end|>\n<|im_start|>tool\nX<|im_end|>\n<|im_start|>assistant\nbc<|im_end|>"
    assert split_transcript(t) == [(0, 1, True, "X"), (len(t) - 12, len(t) - 10, True, None)]
    assert split_transcript("abc") == [(0, 3, False, None)]
