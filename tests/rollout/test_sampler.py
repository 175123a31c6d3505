"""Per-row seeded sampling: the uniforms are uniform and independent of the batch, the draw follows
softmax(logits / T) exactly (a chi-square test at fixed seeds), top-k / top-p narrow it as defined, and the
returned log-probs are the tempered full-vocabulary ones."""
from __future__ import annotations

import math

import pytest
import torch

from gearlab.rollout.sampler import narrow, row_uniforms, sample_rows


def test_uniforms_are_a_function_of_seed_and_step_only():
    seeds = torch.tensor([0, 1, 2**40 + 7, 2**62 + 3])
    u = row_uniforms(seeds, torch.tensor(5))
    assert u.dtype == torch.float32 and ((u >= 0) & (u < 1)).all()
    assert torch.equal(u[2:3], row_uniforms(seeds[2:3], torch.tensor(5)))  # alone or in a batch: the same
    assert not torch.equal(u, row_uniforms(seeds, torch.tensor(6)))
    assert len(set(u.tolist())) == 4  # the high 32 bits of a seed matter too


def test_uniforms_look_uniform_and_uncorrelated():
    seeds = torch.arange(20_000)
    a, b = row_uniforms(seeds, torch.tensor(0)), row_uniforms(seeds, torch.tensor(1))
    # Kolmogorov–Smirnov distance to U(0, 1); the 0.1% critical value at n = 20000 is 1.95 / sqrt(n) = 0.0138
    for x in (a, b):
        s = x.sort().values.double()
        n = len(s)
        d = torch.maximum(torch.arange(1, n + 1) / n - s, s - torch.arange(n) / n).max()
        assert d < 0.0138
    r = torch.corrcoef(torch.stack([a, b]))[0, 1]  # consecutive steps of one row
    assert abs(r) < 0.03
    r_rows = torch.corrcoef(torch.stack([a[:-1], a[1:]]))[0, 1]  # neighbouring rows (seed, seed + 1)
    assert abs(r_rows) < 0.03


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_draws_follow_the_tempered_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 30_000
    tok, lp = sample_rows(logits.expand(n, -1), torch.arange(n) * 7919, torch.tensor(3), temperature=temperature)
    p = torch.softmax(logits / temperature, -1)
    counts = torch.bincount(tok, minlength=6).double()
    chi2 = ((counts - n * p) ** 2 / (n * p)).sum().item()
    assert chi2 < 20.5  # chi-square, 5 degrees of freedom, p = 0.001
    assert torch.allclose(lp, torch.log(p)[tok].float(), atol=1e-6)


def test_greedy_takes_the_argmax_and_reports_its_tempered_logprob():
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, 5.0, 1.0]])
    tok, lp = sample_rows(logits, torch.tensor([1, 2]), torch.tensor(0), temperature=0.5, greedy=True)
    assert tok.tolist() == [1, 0]  # ties: the lowest id
    assert torch.allclose(lp, torch.log_softmax(logits / 0.5, -1)[[0, 1], [1, 0]])


def test_top_k_and_top_p_narrow_the_draw():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    assert torch.isinf(narrow(logits, top_k=2)).tolist() == [[False, False, True, True, True]]
    # nucleus 0.8: 0.5 + 0.2 = 0.7 < 0.8, so the third token is needed; the rest are dropped
    assert torch.isinf(narrow(logits, top_p=0.8)).tolist() == [[False, False, False, True, True]]
    assert torch.isinf(narrow(logits, top_p=0.3)).tolist() == [[False, True, True, True, True]]
    n = 4000
    tok, lp = sample_rows(logits.expand(n, -1), torch.arange(n), torch.tensor(0), temperature=1.0, top_k=2)
    assert set(tok.tolist()) == {0, 1}
    assert abs((tok == 0).double().mean().item() - 0.5 / 0.7) < 0.03
    assert torch.allclose(lp, logits[0, tok])  # the FULL distribution's log-prob, as the trainer computes it
    assert math.isclose(float(torch.exp(lp).max()), 0.5, rel_tol=1e-5)
