"""Per-row seeded sampling: the uniforms are uniform and independent of the batch, the draw follows
softmax(logits / T) exactly (a chi-square test at fixed seeds), top-k / top-p narrow it as defined, and the
returned log-probs are the tempered full-vocabulary ones."""
from __future__ import annotations

import math

import pytest
import torch

from gearlab.rollout.sampler import inverse_cdf, narrow, row_uniforms, sample_rows


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


def test_the_two_level_inverse_cdf_picks_the_single_scans_token_and_never_an_impossible_one():
    """inverse_cdf (a block of 128 tokens, then the token in it) against one scan over the whole vocabulary, on
    vocabularies of several blocks with a ragged last one; and on sparse distributions (whole blocks of zeros,
    u up to the largest uniform) it never returns a token of probability 0."""
    g = torch.Generator().manual_seed(0)
    B, V = 4000, 1000  # 8 blocks, the last one 104 tokens wide
    probs = torch.softmax(3 * torch.randn(B, V, generator=g), -1)
    u = torch.rand(B, generator=g)
    cdf = probs.cumsum(-1)
    ref = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
    assert (inverse_cdf(probs, u) == ref).float().mean() > 0.999  # differs only within float rounding of an edge
    sparse = probs * (torch.rand(B, V, generator=g) < 0.01)
    sparse[:, 128:512] = 0.0  # whole blocks empty
    sparse[:, 5] += 1e-3  # every row keeps some mass
    u = torch.cat([torch.rand(B - 2, generator=g), torch.tensor([0.0, 1 - 2.0**-24])])
    tok = inverse_cdf(sparse, u)
    assert bool((sparse.gather(1, tok[:, None]) > 0).all())
    one = torch.zeros(3, V)
    one[:, 999] = 0.25  # the only possible token is the vocabulary's last
    assert inverse_cdf(one, torch.tensor([0.0, 0.5, 1 - 2.0**-24])).tolist() == [999] * 3
    # all the mass in the first block and the largest uniform: never a token of an empty block after it
    first = torch.zeros(64, V)
    first[:, 3] = torch.linspace(0.1, 0.9, 64)
    assert inverse_cdf(first, torch.full((64,), 1 - 2.0**-24)).tolist() == [3] * 64


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_one_softmax_draw_equals_the_log_softmax_formulation_at_a_qwen_vocabulary(temperature):
    """The common path (no top-k / top-p, not greedy) draws from softmax(z) in one kernel and reports log p of the
    drawn token: the same tokens as drawing from exp(log_softmax(z)), and log-probs equal to log_softmax's to 2e-6,
    over Qwen's 151,936 tokens with peaked and flat rows."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 151_936, generator=g) * torch.linspace(0.5, 12.0, 64)[:, None]
    seeds, step = torch.arange(64) * 104_729, torch.tensor(5)
    tok, lp = sample_rows(logits, seeds, step, temperature=temperature)
    ref_all = torch.log_softmax(logits / temperature, -1)
    ref_tok = inverse_cdf(ref_all.exp(), row_uniforms(seeds, step))
    assert (tok == ref_tok).float().mean() >= 63 / 64  # a draw at an interval's edge may round the other way
    assert (lp - ref_all.gather(-1, tok[:, None]).squeeze(-1)).abs().max() < 2e-6
