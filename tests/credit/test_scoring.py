"""Credit scored against planted errors: known positions, known expected scores (gearlab.credit.scoring)."""
from __future__ import annotations

import math

import pytest
import torch

from gearlab.credit.scoring import auroc, credit_scores, prefix_masks, signal_auroc

# two trajectories of 8 generated tokens (then padding): row 0 goes wrong at tokens 3–4, row 1 at token 5
MASK = torch.tensor([[1] * 8 + [0, 0], [1] * 8 + [0, 0]], dtype=torch.bool)
ERR = torch.zeros(2, 10, dtype=torch.bool)
ERR[0, 3:5] = True
ERR[1, 5] = True
ACTIVE = torch.tensor([True, True])


def test_auroc_matches_the_pair_count_with_ties():
    pos = torch.tensor([3.0, 1.0, 2.0])
    neg = torch.tensor([1.0, 0.0])
    # pairs: (3>1,3>0), (1=1 → ½, 1>0), (2>1, 2>0) → 5.5 / 6
    assert auroc(pos, neg) == pytest.approx(5.5 / 6)
    assert auroc(torch.ones(4), torch.ones(3)) == 0.5
    assert math.isnan(auroc(torch.tensor([]), neg))


def test_prefix_and_after():
    prefix, after, located = prefix_masks(MASK, ERR)
    assert prefix[0].nonzero().flatten().tolist() == [0, 1, 2]
    assert after[0].nonzero().flatten().tolist() == [3, 4, 5, 6, 7]  # the wrong step and what follows, no padding
    assert prefix[1].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert located.tolist() == [True, True]


def test_uniform_credit_scores_exactly_neutral():
    credit = -1.3 * MASK.float()  # GRPO: a failed trajectory gets its (negative) A_i on every generated token
    s = credit_scores(credit, MASK, ERR, ACTIVE)
    assert s["auroc"] == 0.5
    assert s["blame_ratio"] == pytest.approx(1.0)
    # prefix share = the prefix's share of tokens: row 0 3/8, row 1 5/8
    assert s["prefix_share"] == pytest.approx((3 / 8 + 5 / 8) / 2)
    assert s["n"] == 2


def test_blame_on_the_wrong_step_is_rewarded():
    credit = -1.0 * MASK.float()
    credit[0, 3:5] = -3.0  # more blame on row 0's wrong step
    credit[1, 5] = -2.0
    s = credit_scores(credit, MASK, ERR, ACTIVE)
    assert s["auroc"] == 1.0
    # row 0: after = [3, 3, 1, 1, 1] → mean 1.8 over prefix 1 → 1.8; row 1: [2, 1, 1] → 4/3
    assert s["blame_ratio"] == pytest.approx((1.8 + 4 / 3) / 2)
    # row 0: prefix −3 of total −(3+6+3) = 3/12; row 1: −5 of −(5+2+2) = 5/9
    assert s["prefix_share"] == pytest.approx((3 / 12 + 5 / 9) / 2)


def test_blame_on_the_prefix_scores_below_neutral():
    credit = -1.0 * MASK.float()
    credit[0, :3] = -2.0
    credit[1, :5] = -2.0
    s = credit_scores(credit, MASK, ERR, ACTIVE)
    assert s["auroc"] == 0.0 and s["blame_ratio"] < 1


def test_rows_left_out():
    err = ERR.clone()
    err[1] = False
    err[1, 0] = True  # error at the first token: no prefix
    credit = -1.0 * MASK.float()
    s = credit_scores(credit, MASK, err, ACTIVE)
    assert s["n"] == 1  # only row 0
    # an unlocated row and an inactive row are not scored
    s = credit_scores(credit, MASK, ERR, torch.tensor([False, True]))
    assert s["n"] == 1
    none = credit_scores(credit, MASK, torch.zeros_like(ERR), ACTIVE)
    assert none["n"] == 0 and math.isnan(none["auroc"]) and math.isnan(none["blame_ratio"])


def test_all_correct_batch_scores_nothing():
    s = credit_scores(torch.ones(2, 10) * MASK, MASK, torch.zeros_like(ERR), ACTIVE, onsets=torch.zeros_like(ERR))
    assert s["n"] == 0 and s["n_onset"] == 0 and math.isnan(s["onset_recall"])


def test_zero_prefix_blame_drops_the_ratio_only():
    credit = torch.zeros(2, 10)
    credit[0, 3] = -1.0  # all blame on the error, none on the prefix: the ratio is undefined
    s = credit_scores(credit, MASK, ERR, torch.tensor([True, False]))
    assert s["n"] == 1 and s["n_blame_ratio"] == 0 and math.isnan(s["blame_ratio"])
    # tokens 3 (−1) vs prefix (0): 1 of 2 wrong-step tokens beats all 3 prefix tokens, the other ties them
    assert s["auroc"] == pytest.approx((1 + 0.5) / 2)
    assert s["prefix_share"] == 0.0


def test_onset_precision_and_recall():
    onsets = torch.zeros(2, 10, dtype=torch.bool)
    onsets[0, 1] = True  # in the prefix: a false onset
    onsets[0, 4] = True  # inside row 0's wrong step
    onsets[1, 7] = True  # after row 1's wrong step: misses it
    s = credit_scores(-MASK.float(), MASK, ERR, ACTIVE, onsets=onsets)
    assert s["onset_precision"] == pytest.approx(1 / 3)
    assert s["onset_recall"] == pytest.approx(1 / 2)


def test_signal_detector_auroc():
    sig = torch.zeros(2, 10)
    sig[0, 3] = 5.0  # a spike on row 0's wrong step
    sig[1, 2] = 5.0  # a spike in row 1's prefix
    a, n = signal_auroc(sig, MASK, ERR)
    # row 0: wrong-step tokens [5, 0] vs prefix [0, 0, 0] → (1 + 0.5) / 2 = 0.75; row 1: [0] vs [0,0,5,0,0] → 0.4
    assert n == 2 and a == pytest.approx((0.75 + 0.4) / 2)
