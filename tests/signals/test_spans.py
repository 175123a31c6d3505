"""Error spans to response tokens (``error_token_mask``, ``locate_errors``) on the embedded tiny tokenizer."""
from __future__ import annotations

import pytest
import torch

from gearlab.core.batch import RolloutBatch
from gearlab.rollout.base import SamplingParams
from gearlab.rollout.multiturn import MultiTurnRolloutEngine, observation_text
from gearlab.signals.spans import _char_starts, error_token_mask, locate_errors
from gearlab.tasks.registry import get_task
from tests.rollout.scripted import ScriptedPolicy, action_ids

SOL = ["7+5=12\n12*3=35\nAnswer: 35", "7+5=12\nAnswer: 12"]


def _enc(tok, s):
    return tok(s, add_special_tokens=False)["input_ids"]


def _batch(tok, sols, extra_pad=2):
    """Single-turn rows: text + stop token, right-padded (``extra_pad`` beyond the longest); meta texts made as
    the single-turn engine makes them (batch_decode of the masked response, special tokens skipped)."""
    r = [_enc(tok, s) + [tok.eos_token_id] for s in sols]
    T, pad, n = max(map(len, r)) + extra_pad, tok.pad_token_id, len(sols)
    rid = torch.tensor([x + [pad] * (T - len(x)) for x in r])
    rm = torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x in r], dtype=torch.bool)
    texts = tok.batch_decode(rid.masked_fill(~rm, pad), skip_special_tokens=True)
    return RolloutBatch(prompt_ids=torch.full((n, 2), pad), prompt_mask=torch.ones(n, 2, dtype=torch.long),
                        response_ids=rid, response_mask=rm, group_ids=torch.zeros(n, dtype=torch.long),
                        rewards=torch.zeros(n), meta={"texts": list(texts)})


def _marked(mask, row):
    return mask[row].nonzero().flatten().tolist()


def test_span_marks_exactly_its_tokens(tokenizer):
    b = _batch(tokenizer, SOL)
    assert b.meta["texts"] == SOL
    pieces = [tokenizer.decode([i]) for i in b.response_ids[0].tolist()]
    assert pieces[7:14] == ["1", "2", "*", "3", "=", "3", "5"] and pieces[20] == "<|im_end|>"
    m = error_token_mask(tokenizer, b, [(7, 14), (7, 17)])  # "12*3=35" / "Answer: 12"
    assert m.dtype == torch.bool and m.shape == b.response_ids.shape
    assert _marked(m, 0) == list(range(7, 14))
    assert _marked(m, 1) == [7, 8, 9, 10, 11]  # "Answer", ":", " ", "1", "2"


@pytest.mark.parametrize("span, tokens", [
    ((8, 9), [8]),  # one character: the "2" of "12"
    ((16, 17), [15]),  # a character inside the token "Answer"
    ((14, 16), [14, 15]),  # "\nA": the newline and the token "Answer" it reaches into
    ((23, 25), [18, 19]),  # the answer's value at the very end
])
def test_partial_overlaps(tokenizer, span, tokens):
    b = _batch(tokenizer, SOL[:1])
    assert _marked(error_token_mask(tokenizer, b, [span]), 0) == tokens


def test_stop_token_padding_none_and_empty_spans(tokenizer):
    b = _batch(tokenizer, SOL)
    m = error_token_mask(tokenizer, b, [(-5, 10_000), None])  # clipped to the text: every character
    assert _marked(m, 0) == list(range(len(_enc(tokenizer, SOL[0]))))  # stop token (20) and padding not marked
    assert not m[1].any()
    for span in [(5, 5), (9, 3), (30, 40)]:  # empty, reversed, beyond the text
        assert not error_token_mask(tokenizer, b, [span, span]).any()
    with pytest.raises(ValueError, match="spans"):
        error_token_mask(tokenizer, b, [None])


def test_row_whose_text_does_not_match_gets_nothing(tokenizer):
    b = _batch(tokenizer, SOL)
    b.meta["texts"][0] = "7+5=12\n12*3=36\nAnswer: 35"  # same length, one character differs
    m = error_token_mask(tokenizer, b, [(7, 14), (7, 17)])
    assert not m[0].any() and _marked(m, 1) == [7, 8, 9, 10, 11]


def test_characters_split_over_byte_tokens(tokenizer):
    """"é" is 2 byte tokens, the emoji 4: the pieces do not concatenate (slow path), tokens are grouped."""
    text = "\u00e9\U0001F642\n7+5=13\nAnswer: 39"
    b = _batch(tokenizer, [text])
    ids = b.response_ids[0, : len(_enc(tokenizer, text))].tolist()
    assert b.meta["texts"] == [text] and _char_starts(tokenizer, ids, text) is None
    cases = {(0, 1): [0, 1], (1, 2): [2, 3, 4, 5], (1, 3): [2, 3, 4, 5, 6], (3, 9): list(range(7, 13)),
             (10, 20): list(range(14, 19)), (0, 100): list(range(19))}
    for span, tokens in cases.items():
        assert _marked(error_token_mask(tokenizer, b, [span]), 0) == tokens, span


def test_locate_errors_single_turn(tokenizer):
    task = get_task("arith")
    p = task.make_problem([7, 5, 3], ["+", "*"])
    b = _batch(tokenizer, [SOL[0], p.solution, "7+5=13\n13*3=39\nAnswer: 39"])
    m, spans = locate_errors(task, tokenizer, b, [p, p, p])
    assert spans == [(7, 14), None, (0, 6)]
    assert _marked(m, 0) == list(range(7, 14)) and not m[1].any() and _marked(m, 2) == list(range(6))
    with pytest.raises(ValueError, match="one problem per row"):
        locate_errors(task, tokenizer, b, [p])
    b.meta.pop("texts")
    with pytest.raises(ValueError, match="texts"):
        locate_errors(task, tokenizer, b, [p, p, p])


def test_locate_errors_multi_turn_marks_the_policy_action_only(tokenizer):
    """A real multi-turn batch: the wrong call's tokens are marked (not its stop token); environment tokens never."""
    task = get_task("tool_arith")
    good, bad = task.make_problem([12, 3, 5], ["*", "+"]), task.make_problem([11, 4, 6], ["+", "*"])  # 41 / 90
    bad_acts = ["<call>calc 11+4</call>", "<call>calc 15+6</call>", "Answer: 21"]  # 2nd call: wrong operator

    def script(text, turn):
        acts = bad_acts if bad.prompt in text else task.demo_actions(good)
        return action_ids(tokenizer, acts[min(turn, len(acts) - 1)])

    eng = MultiTurnRolloutEngine(tokenizer, task, max_turns=4, step_workers=1)
    rb = eng.generate(ScriptedPolicy(tokenizer, script), [good, bad], group_size=1,
                      sampling=SamplingParams(max_new_tokens=40, greedy=True), seed=0)
    assert rb.rewards.tolist() == [1.0, 0.0]
    m, spans = locate_errors(task, tokenizer, rb, [good, bad])
    text = rb.meta["texts"][1]
    assert spans[0] is None and text[spans[1][0]:spans[1][1]] == "<call>calc 15+6</call>"
    start = len(action_ids(tokenizer, bad_acts[0])) + len(_enc(tokenizer, observation_text("15")))
    assert not m[0].any()
    assert _marked(m, 1) == list(range(start, start + len(_enc(tokenizer, bad_acts[1]))))
    assert rb.response_mask[1, start + len(_enc(tokenizer, bad_acts[1]))]  # its stop token: generated, not marked
    # the whole transcript as the span: exactly the generated non-special tokens, no environment token
    whole = error_token_mask(tokenizer, rb, [(0, len(t)) for t in rb.meta["texts"]])
    special = torch.isin(rb.response_ids, torch.tensor(tokenizer.all_special_ids))
    assert torch.equal(whole, rb.response_mask & ~special)
    assert (rb.attention_mask & ~rb.response_mask).any() and not (whole & ~rb.response_mask).any()
