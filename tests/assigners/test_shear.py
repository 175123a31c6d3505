"""SHEAR (assigners/shear.py, gearlab/signals/span_wasserstein.py; a reconstruction, docs/credit/shear.md): the
Sinkhorn distance within the entropic bound of the exact Wasserstein-1 distance, the spans, the weights' fall-back
and masks, a planted divergence found, the signal on the tiny model, the contract kit."""
import math

import pytest
import torch
from scipy.optimize import linear_sum_assignment

from gearlab.core.batch import RolloutBatch
from gearlab.credit.contract import assert_contract
from gearlab.signals.registry import SignalContext
from gearlab.signals.span_wasserstein import shear_weights, sinkhorn_w1, span_starts, span_wasserstein


@pytest.mark.parametrize("eps", [0.5, 0.1, 0.02])
def test_sinkhorn_is_within_the_entropic_bound_of_exact_w1(eps):
    """W1 ≤ W_ε ≤ W1 + ε log n; with equal sizes and uniform mass W1 is an assignment problem (solved exactly)."""
    g = torch.Generator().manual_seed(0)
    n = 12
    x, y = torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randn(n, 5, generator=g, dtype=torch.float64) + 1
    c = torch.cdist(x, y)
    r, col = linear_sum_assignment(c.numpy())
    w1 = float(c[r, col].mean())
    ones = torch.ones(1, n, dtype=torch.bool)
    w = float(sinkhorn_w1(c[None], ones, ones, eps, iters=2000, tol=1e-9)[0])
    assert w1 - 1e-9 <= w <= w1 + eps * math.log(n) + 1e-9


def test_spans_cover_every_token_with_the_fewest_windows():
    assert span_starts(300, 100, 25)[0].tolist() == [0, 25, 50, 75, 100, 125, 150, 175, 200]
    starts, lens = span_starts(310, 100, 25)
    assert int(starts[-1] + lens[-1]) == 310 and lens.tolist()[-1] == 85 and len(starts) == 10
    assert span_starts(40, 100, 25)[1].tolist() == [40]  # shorter than a span: one span


def _group(seed, T=48, H=6, tau=24, shift=3.0):
    """A group of 3 correct and 3 incorrect responses along one noisy path; the incorrect ones leave it after tau."""
    g = torch.Generator().manual_seed(seed)
    path = torch.randn(T, H, generator=g).cumsum(0) * 0.3 + 5
    hidden = path[None].repeat(6, 1, 1) + 0.2 * torch.randn(6, T, H, generator=g)
    hidden[3:, tau:] += shift
    return hidden, torch.tensor([1.0, 1, 1, 0, 0, 0])


def test_weights_rise_after_a_planted_divergence_in_both_outcomes():
    hidden, rewards = _group(0)
    mask = torch.ones(6, 48, dtype=torch.bool)
    w = shear_weights(hidden, mask, rewards, torch.zeros(6, dtype=torch.long), span_len=8, stride=2)
    pre, post = w[:, :16].mean(1), w[:, 32:].mean(1)
    assert (post > 1.5 * pre).all() and (w >= 0).all()


def test_single_outcome_groups_get_one_and_masked_positions_zero():
    hidden, _ = _group(1)
    mask = torch.ones(6, 48, dtype=torch.bool)
    mask[2, 40:] = False
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    rewards = torch.tensor([1.0, 1, 1, 0, 0, 0])  # group 0 all correct, group 1 all wrong
    w = shear_weights(hidden, mask, rewards, groups, span_len=8, stride=2)
    assert (w[mask] == 1.0).all() and (w[~mask] == 0).all()


def test_the_signal_on_a_model_is_deterministic_and_nonnegative(tokenizer, tiny_model_factory):
    model = tiny_model_factory(0).eval()
    g = torch.Generator().manual_seed(0)
    B, P, T = 6, 5, 10
    mask = torch.arange(T)[None] < torch.tensor([10, 8, 9, 10, 7, 10])[:, None]
    batch = RolloutBatch(prompt_ids=torch.randint(5, 50, (B, P), generator=g),
                         prompt_mask=torch.ones(B, P, dtype=torch.long),
                         response_ids=torch.randint(5, 50, (B, T), generator=g), response_mask=mask,
                         group_ids=torch.tensor([0, 0, 0, 1, 1, 1]), rewards=torch.tensor([1.0, 0, 1, 1, 1, 1]))
    ctx = SignalContext(model, tokenizer, batch, 1.0, 256, 2, {"span_len": 4, "stride": 2})
    w = span_wasserstein(ctx)
    torch.testing.assert_close(w, span_wasserstein(SignalContext(model, tokenizer, batch, 1.0, 256, 6,
                                                                 {"span_len": 4, "stride": 2})))
    assert (w[3:][mask[3:]] == 1.0).all()  # group 1: all correct
    assert (w[:3][mask[:3]] > 0).all() and not (w[:3][mask[:3]] == 1.0).all() and (w[~mask] == 0).all()


def test_shear_passes_the_contract_kit():
    assert_contract("shear")
    assert_contract("shear", {"span_len": 8, "stride": 2})


def test_span_pairs_solved_in_chunks_give_the_values_of_one_batch():
    """The span pairs are solved a chunk at a time (memory at reasoning lengths); each Sinkhorn problem stops on its
    own, so a value does not depend on which pairs share its chunk."""
    from gearlab.signals.span_wasserstein import span_distances

    g = torch.Generator().manual_seed(0)
    xa, xb = torch.randn(37, 8, generator=g), torch.randn(23, 8, generator=g) + 0.3
    whole = span_distances(xa, xb, span_len=8, stride=3, eps=0.05)
    for chunk in (64, 64 * 5, 64 * 7 + 1):  # 1, 5 and 7 pairs at a time
        torch.testing.assert_close(span_distances(xa, xb, 8, 3, 0.05, chunk_elements=chunk), whole,
                                   rtol=0, atol=1e-6)
    assert whole.shape == (11, 6) and bool((whole > 0).all())
