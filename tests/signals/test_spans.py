"""Characters to response tokens on the embedded tiny tokenizer: the reasoning / answer segments
(``response_segments``) and error spans (``error_token_mask``, ``locate_errors``)."""
from __future__ import annotations

import pytest
import torch

from gearlab.core.batch import RolloutBatch
from gearlab.rollout.base import SamplingParams
from gearlab.rollout.multiturn import MultiTurnRolloutEngine, observation_text
from gearlab.signals.spans import _char_starts, _split_text, error_token_mask, locate_errors, response_segments
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


def _segments_by_definition(tok, ids_row, mask_row):
    """The three segments of one row straight from the module's definition: token k covers the characters
    [len(decode(ids[:k])), len(decode(ids[:k+1]))) of the decoded generated tokens; special tokens are in none."""
    pos = [p for p, m in enumerate(mask_row) if m]
    ids = [ids_row[p] for p in pos]
    text = tok.decode(ids, skip_special_tokens=True)
    out = {"reasoning": set(), "conclude": set(), "value": set()}
    cut = _split_text(text) if ids else None
    if cut is None:
        return out
    ends = [len(tok.decode(ids[: k + 1], skip_special_tokens=True)) for k in range(len(ids))]
    assert ends == sorted(ends)  # monotone prefixes: "the first token ending after a character" is well defined
    a = next((k for k, e in enumerate(ends) if e > cut[0]), len(ids))
    v = next((k for k, e in enumerate(ends) if e > cut[1]), len(ids)) if cut[1] < len(text) else len(ids)
    for k, (p, t) in enumerate(zip(pos, ids)):
        if t not in tok.all_special_ids:
            out["reasoning" if k < a else "conclude" if k < v else "value"].add(p)
    return out


def test_response_segments_equal_their_definition_on_random_rows(tokenizer):
    """Rows mixing arithmetic lines, 2-byte characters (the pieces then do not concatenate: bisection), stop
    and pad tokens inside the row, positions outside ``response_mask`` and no answer marker; every row's three
    masks equal the per-token definition, on the first call and again once each token's text is cached."""
    g = torch.Generator().manual_seed(0)
    chunks = ["7+5=12\n", "12*3=36\n", " so ", "carry 1", "\u00e9", "\n", "x", "Answer: 41", "Answer:  7"]
    special = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    rows, masks = [], []
    for _ in range(40):
        pick = torch.randint(len(chunks), (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
        ids = _enc(tokenizer, "".join(chunks[i] for i in pick))
        for _ in range(int(torch.randint(0, 3, (1,), generator=g))):  # a special token somewhere inside
            ids.insert(int(torch.randint(len(ids) + 1, (1,), generator=g)), special[int(torch.randint(2, (1,),
                                                                                               generator=g))])
        keep = (torch.rand(len(ids), generator=g) > 0.1).tolist()  # ~10% of the positions not generated
        rows.append(ids + [tokenizer.eos_token_id])
        masks.append(keep + [True])
    T = max(map(len, rows)) + 2
    rid = torch.tensor([r + [tokenizer.pad_token_id] * (T - len(r)) for r in rows])
    rm = torch.tensor([m + [False] * (T - len(m)) for m in masks])
    for _ in range(2):  # cold, then warm per-token cache
        seg = response_segments(tokenizer, rid, rm)
        for b in range(len(rows)):
            want = _segments_by_definition(tokenizer, rid[b].tolist(), rm[b].tolist())
            got = {k: set(getattr(seg, k)[b].nonzero().flatten().tolist()) for k in want}
            assert got == want, b
    assert sum(len(_segments_by_definition(tokenizer, rid[b].tolist(), rm[b].tolist())["value"]) > 0
               for b in range(len(rows))) > 10  # the rows do exercise all three segments


def _overlapping_by_definition(tok, ids, text, start, end):
    """Tokens grouped between every clean boundary k (decode(ids[:k]) a prefix of the text, not shorter than the
    previous one), each prefix decoded; a group is marked whole when its characters overlap [start, end)."""
    out, a, ca = [], 0, 0
    for b in range(1, len(ids) + 1):
        prefix = tok.decode(ids[:b], skip_special_tokens=True)
        if len(prefix) < ca or not text.startswith(prefix):
            continue
        if len(prefix) > ca and len(prefix) > start and ca < end:
            out += range(a, b)
        a, ca = b, len(prefix)
    return out


def test_error_spans_with_split_characters_equal_their_definition(tokenizer):
    """Rows with 2- and 4-byte characters among arithmetic lines (and special tokens inside): the marked tokens of
    random spans equal the per-prefix definition; the rows do take the slow path and mark split characters."""
    g = torch.Generator().manual_seed(1)
    chunks = ["7+5=12\n", "12*3=36\n", " so ", "\u00e9", "\U0001F642", "\u00e9\u00e9", "Answer: 41"]
    split_marked = 0
    for _ in range(30):
        pick = torch.randint(len(chunks), (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()
        text = "".join(chunks[i] for i in pick)
        if not any(ord(c) > 127 for c in text):
            text += "\u00e9"
        ids = _enc(tokenizer, text)
        if torch.rand(1, generator=g) < 0.5:
            ids.insert(int(torch.randint(len(ids) + 1, (1,), generator=g)), tokenizer.eos_token_id)
        b = _batch(tokenizer, [tokenizer.decode(ids, skip_special_tokens=True)])
        b.response_ids[0, : len(ids)] = torch.tensor(ids)
        assert b.meta["texts"][0] == text and _char_starts(tokenizer, ids, text) is None
        for _ in range(4):
            s = int(torch.randint(len(text), (1,), generator=g))
            e = s + int(torch.randint(1, 12, (1,), generator=g))
            want = [k for k in _overlapping_by_definition(tokenizer, ids, text, s, e)
                    if ids[k] != tokenizer.eos_token_id]
            assert _marked(error_token_mask(tokenizer, b, [(s, e)]), 0) == want, (text, s, e)
            split_marked += any(ord(c) > 127 for c in text[s:e])
    assert split_marked > 10
