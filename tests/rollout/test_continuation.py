"""Continuing responses from their prefixes (gearlab.rollout.continuation) and Monte-Carlo step values
(gearlab.rollout.mc): a continuation given the response's own seed reproduces it on HF ``generate`` and on the fast
decoder; other seeds give other continuations within the response budget; MC values on a hand-made task match the
values computed exactly from the policy's distribution, within their standard errors."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gearlab.rollout.base import SamplingParams
from gearlab.rollout.continuation import continue_from
from gearlab.rollout.fast import FastDecoder
from gearlab.rollout.hf import HFRolloutEngine
from gearlab.rollout.mc import mc_values
from gearlab.signals.mc import broadcast_steps, token_step_ends
from gearlab.tasks.base import Problem
from gearlab.tasks.registry import get_task

SP = SamplingParams(max_new_tokens=10)


def _engines(tokenizer, task):
    return {"hf": HFRolloutEngine(tokenizer, task, batch_size=8),
            "fast": HFRolloutEngine(tokenizer, task, batch_size=8, generator=FastDecoder(tokenizer, bucket=8))}


@pytest.mark.parametrize("engine", ["hf", "fast"])
def test_a_continuation_with_the_responses_own_seed_reproduces_it(tokenizer, tiny_model_factory, engine):
    model = tiny_model_factory(0)
    task = get_task("arith")
    eng = _engines(tokenizer, task)[engine]
    ids, mask = eng.encode_prompts(task.problems("train", 6, seed=3))
    resp, rmask, _ = eng.sample_with_logprobs(model, ids, mask, SP, 500)  # row i drew with seed 500 + i
    lengths = rmask.sum(1).tolist()
    assert sorted(lengths)[1] >= 4 and max(lengths) == SP.max_new_tokens  # one row stopped early, most ran on
    for cut in (0, 1, 3):
        cuts = [min(cut, m) for m in lengths]
        cont, cmask = continue_from(eng, model, ids, mask, resp, rmask, cuts, SP, torch.arange(6) + 500)
        assert torch.equal(cmask, rmask[:, : cmask.shape[1]]) and not rmask[:, cmask.shape[1]:].any()
        assert torch.equal(cont[cmask], resp[:, : cmask.shape[1]][cmask]), cut
    whole = continue_from(eng, model, ids, mask, resp, rmask, lengths, SP, torch.arange(6) + 500)  # nothing to draw
    assert torch.equal(whole[1], rmask[:, : whole[1].shape[1]])
    cuts = [min(2, m) for m in lengths]
    other, omask = continue_from(eng, model, ids, mask, resp, rmask, cuts, SP, torch.arange(6) + 900)
    assert torch.equal(other[:, :2][omask[:, :2]], resp[:, :2][omask[:, :2]])  # the prefix is kept
    assert int(omask.sum(1).max()) <= SP.max_new_tokens
    differs = [not torch.equal(other[i][omask[i]], resp[i][rmask[i]]) for i in range(6)]
    assert sum(differs) >= 4
    with pytest.raises(ValueError, match="each cut must lie"):
        continue_from(eng, model, ids, mask, resp, rmask, [max(lengths) + 1] * 6, SP, torch.arange(6))


class ParityTask:
    """A hand-made verifier on top of arith's prompts: reward 1 when the completion's text has an even length;
    every character is a step, so every token boundary is a step end."""

    def __init__(self):
        self.base = get_task("arith")
        self.name = "parity"

    def __getattr__(self, k):
        return getattr(self.base, k)

    def reward(self, problem: Problem, completion: str) -> float:
        return float(len(completion) % 2 == 0)

    def step_ends(self, completion: str) -> list[int]:
        return list(range(1, len(completion) + 1)) or [0]


def _exact_value(model, tokenizer, task, prompt: list[int], prefix: list[int], left: int, stops: set[int]) -> float:
    """E[r] over every continuation of at most ``left`` tokens, enumerated from the policy's softmax (T = 1)."""
    def text(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    x = torch.tensor([prompt + prefix])
    p = torch.softmax(model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0, -1].float(), -1)
    if left == 1:
        r = torch.tensor([task.reward(None, text(prefix + ([] if a in stops else [a]))) for a in range(p.numel())])
        return float((p * r).sum())
    return float(sum(p[a] * (task.reward(None, text(prefix)) if a in stops else
                             _exact_value(model, tokenizer, task, prompt, prefix + [a], left - 1, stops))
                     for a in range(p.numel()) if p[a] > 1e-3 or a in stops))


def test_mc_values_match_the_exact_values_of_a_hand_made_task(tokenizer, tiny_model_factory):
    model = tiny_model_factory(1)
    task = ParityTask()
    eng = HFRolloutEngine(tokenizer, task, batch_size=64)
    probs = task.problems("train", 2, seed=4)
    sp = SamplingParams(max_new_tokens=4)
    ids, mask = eng.encode_prompts(probs)
    resp, rmask = eng.sample(model, ids, mask, sp, 11)
    texts = tokenizer.batch_decode(resp.masked_fill(~rmask, tokenizer.pad_token_id), skip_special_tokens=True)
    rewards = eng.score(probs, texts)
    rb = SimpleNamespace(prompt_ids=ids, prompt_mask=mask, response_ids=resp, response_mask=rmask, rewards=rewards)
    values, cost = mc_values(eng, model, probs, rb, k=300, max_steps=10, sampling=sp, seed=7)
    stops = set(eng._stop_ids())
    checked = 0
    for n, sv in enumerate(values):
        toks = resp[n][rmask[n]].tolist()
        assert sv.ends == token_step_ends(tokenizer, task.step_ends, toks) and sv.ends[-1] == len(toks)
        assert sv.values[-1] == float(rewards[n]) and sv.stderr[-1] == 0.0
        prompt = ids[n][mask[n].bool()].tolist()
        for j, e in enumerate(sv.ends[:-1]):
            if sp.max_new_tokens - e > 2:
                continue  # exact enumeration only for the last two tokens of the budget
            exact = _exact_value(model, tokenizer, task, prompt, toks[:e], sp.max_new_tokens - e, stops)
            assert abs(sv.values[j] - exact) <= 4 * sv.stderr[j] + 1e-9, (n, e, sv.values[j], exact, sv.stderr[j])
            assert 0.01 < sv.stderr[j] < 0.05
            checked += 1
    assert checked >= 2
    assert cost["continuations"] == 300 * sum(len(sv.ends) for sv in values) and cost["tokens"] > 0
    assert len(values[0].advantages) == len(values[0].ends) and 0 <= values[0].onset < len(values[0].ends)
    per_token = broadcast_steps(values, rmask)  # every token is a step here: A_j lands on token j
    for n, sv in enumerate(values):
        assert per_token[n][rmask[n]].tolist() == pytest.approx(sv.advantages)
        assert not per_token[n][~rmask[n]].any()


class _SeedResampler:
    """Rewards that are a function of the seed alone: what matters is which seeds each row's points draw."""

    def __init__(self, ends):
        self.ends, self.calls = ends, []

    def step_ends(self, row):
        return self.ends[row]

    def rewards(self, rows, cuts, seeds):
        self.calls.append((list(rows), list(cuts), seeds.tolist()))
        return (seeds * 2654435761 % 97 < 40).float()


def test_a_rows_continuations_depend_on_its_global_row_not_its_neighbours():
    from gearlab.signals.mc import step_values

    ends = [[3, 5, 9], [2, 7], [4]]
    both = step_values(_SeedResampler(ends), torch.tensor([0.0, 1.0, 0.0]), k=4, max_steps=8, seed=100)
    alone = step_values(_SeedResampler(ends[1:2]), torch.tensor([1.0]), k=4, max_steps=8, seed=100, first_row=1)
    assert alone[0] == both[1]  # row 1 alone on a "rank" whose first global row is 1: the same draws
    rs = _SeedResampler(ends)
    step_values(rs, torch.tensor([0.0, 1.0, 0.0]), k=4, max_steps=8, seed=100)
    seeds = rs.calls[0][2]
    assert len(seeds) == len(set(seeds)) == 4 * (3 + 2 + 1)  # every continuation its own seed
    assert rs.calls[0][1][:12] == [0] * 4 + [3] * 4 + [5] * 4  # row 0: the prompt, then its interior step ends
