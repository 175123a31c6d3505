"""The per-iteration credit statistics: hand values, GRPO against itself, the normalisation in words."""
import pytest
import torch

from gearlab.credit.diagnostics import credit_diagnostics, normalisation_scope


def test_hand_values():
    seq = torch.tensor([1.0, -2.0, 0.0])
    adv = torch.tensor([[2.0, 0.5, -1.0], [-2.0, -3.0, 9.0], [0.5, 7.0, 7.0]])
    resp = torch.tensor([[True, True, True], [True, True, False], [True, False, False]])
    loss = torch.tensor([[True, False, True], [True, True, True], [True, True, True]])
    # effective credit on generated tokens: [2, 0, −1], [−2, −3], [0.5]; |A_i| = 1, 1, 1, 2, 2, 0
    d = credit_diagnostics(adv, seq, resp, loss)
    e = torch.tensor([2.0, 0.0, -1.0, -2.0, -3.0, 0.5])
    assert d["adv_mean"] == pytest.approx(-3.5 / 6) and d["adv_abs_mean"] == pytest.approx(8.5 / 6)
    assert d["adv_std"] == pytest.approx(float(e.std()))  # unbiased
    assert d["abs_up_frac"] == pytest.approx(3 / 6)  # 2 > 1, 3 > 2, 0.5 > 0
    assert d["abs_down_frac"] == pytest.approx(1 / 6)  # the token outside the loss: 0 < 1
    assert d["sign_flip_frac"] == pytest.approx(1 / 6)  # −1 where A = +1
    assert d["zero_frac"] == pytest.approx(1 / 6)


def test_grpo_broadcast_is_unchanged_up_to_rounding():
    g = torch.Generator().manual_seed(0)
    seq = torch.randn(8, generator=g)
    resp = torch.rand(8, 12, generator=g) > 0.3
    adv = seq[:, None] * resp * (1 + 1e-8)  # float noise far below the tolerance
    d = credit_diagnostics(adv, seq, resp, resp)
    assert d["abs_up_frac"] == d["abs_down_frac"] == d["sign_flip_frac"] == d["zero_frac"] == 0.0
    assert d["adv_mean"] == pytest.approx(float(seq[:, None].expand(8, 12)[resp].mean()), rel=1e-6)
    empty = credit_diagnostics(adv, seq, torch.zeros_like(resp), resp)
    assert set(empty.values()) == {0.0}


def test_normalisation_in_words():
    assert normalisation_scope(True, "group", False) == "group mean, divided by group std (unbiased)"
    assert normalisation_scope(True, "batch", False) == "group mean, divided by batch std (unbiased)"
    assert normalisation_scope(False, "batch", False) == "group mean, no std scaling"
    assert normalisation_scope(
        True, "group", True
    ) == "leave-one-out group mean, divided by the other group members' std"
