"""entropy_fork (docs/credit/entropy_fork.md): top-ρ entropy selection, both normalisers, both scopes."""
import pytest
import torch

from assigners.entropy_fork import top_fraction_mask
from gearlab import credit
from gearlab.core.batch import RolloutBatch
from gearlab.credit import Signal

E = Signal.ENTROPY


def _batch(mask) -> RolloutBatch:
    return RolloutBatch.from_masks(mask)


MASK = [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]]
# values at masked positions are deliberately huge: they must never be selected
ENT = torch.tensor([[0.1, 0.9, 0.3, 0.2, 5.0], [0.8, 0.05, 0.4, 9.0, 9.0]])
ADV = torch.tensor([1.0, -0.5])


def test_paper_normaliser_selects_top_k_and_keeps_advantages():
    # N_valid = 7, ρ = 0.2 → k = int(7·0.2 + 0.9999) = int(2.3999) = 2
    # valid entropies: .1 .9 .3 .2 | .8 .05 .4 → top-2 = 0.9 at (0,1), 0.8 at (1,0)
    out = credit.build("entropy_fork").assign(_batch(MASK), ADV, {E: ENT})
    assert out.loss_mask.tolist() == [[False, True, False, False, False], [True, False, False, False, False]]
    # advantages unchanged: A_i · m_{i,t}
    assert out.token_advantages.tolist() == [[1.0, 1.0, 1.0, 1.0, 0.0], [-0.5, -0.5, -0.5, 0.0, 0.0]]
    assert out.metrics["entropy_fork/frac_selected"] == pytest.approx(2 / 7)
    assert out.metrics["entropy_fork/entropy_selected_mean"] == pytest.approx((0.9 + 0.8) / 2)  # 0.85
    # (.1+.9+.3+.2+.8+.05+.4) / 7 = 2.75 / 7
    assert out.metrics["entropy_fork/entropy_all_mean"] == pytest.approx(2.75 / 7)


def test_trl_normaliser_zeroes_unselected_and_keeps_full_mask():
    out = credit.build("entropy_fork", {"normaliser": "trl"}).assign(_batch(MASK), ADV, {E: ENT})
    assert out.loss_mask is None  # token-mean still divides by all 7 active tokens
    assert out.token_advantages.tolist() == [[0.0, 1.0, 0.0, 0.0, 0.0], [-0.5, 0.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("n,rho,k", [(5, 0.2, 1),     # 5·0.2 = 1.0 → int(1.9999) = 1
                                     (7, 0.2, 2),     # 1.4 → int(2.3999) = 2
                                     (10, 0.25, 3),   # 2.5 → int(3.4999) = 3
                                     (3, 0.01, 1),    # 0.03 → int(1.0299) = 1
                                     (4, 1.0, 4)])    # ρ = 1 keeps every valid token
def test_k_is_ceil_as_in_the_paper_code(n, rho, k):
    ent = torch.arange(n, dtype=torch.float32)[None]
    sel = top_fraction_mask(ent, torch.ones(1, n, dtype=torch.bool), rho)
    assert int(sel.sum()) == k
    assert sel[0, n - k:].all()  # the k largest are the last k


def test_ties_select_exactly_k_and_respect_the_order():
    # all equal: exactly k = int(10·0.2 + 0.9999) = 2 of the 10 tokens
    sel = top_fraction_mask(torch.full((2, 5), 0.5), torch.ones(2, 5, dtype=torch.bool), 0.2)
    assert int(sel.sum()) == 2
    # tie at the boundary: [.9 .5 .5 .5 .1], ρ = 0.4 → k = int(2.0 + 0.9999) = 2: .9 and one of the .5s
    sel = top_fraction_mask(torch.tensor([[0.9, 0.5, 0.5, 0.5, 0.1]]), torch.ones(1, 5, dtype=torch.bool), 0.4)
    assert int(sel.sum()) == 2 and bool(sel[0, 0]) and not bool(sel[0, 4])
    assert int(sel[0, 1:4].sum()) == 1


def test_empty_mask_gives_zeros_and_no_selection():
    b = _batch([[0, 0, 0], [0, 0, 0]])
    for norm in ("paper", "trl"):
        out = credit.build("entropy_fork", {"normaliser": norm}).assign(
            b, torch.tensor([1.0, -1.0]), {E: torch.zeros(2, 3)}
        )
        assert out.token_advantages.abs().sum() == 0
        assert out.loss_mask is None or not out.loss_mask.any()
        assert out.metrics["entropy_fork/frac_selected"] == 0.0


def test_all_zero_advantages_stay_zero():
    for norm in ("paper", "trl"):
        out = credit.build("entropy_fork", {"normaliser": norm}).assign(_batch(MASK), torch.zeros(2), {E: ENT})
        assert torch.equal(out.token_advantages, torch.zeros(2, 5))


def test_micro_batch_scope_selects_per_row_chunk():
    # rows 0-1 have high entropy, rows 2-3 low; 5 valid tokens per row
    ent = torch.tensor([[5.0, 6.0, 7.0, 8.0, 9.0], [5.5, 6.5, 7.5, 8.5, 9.5],
                        [0.1, 0.2, 0.3, 0.4, 0.5], [0.15, 0.25, 0.35, 0.45, 0.55]])
    b = _batch(torch.ones(4, 5))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    # batch: N = 20 → k = int(4.0 + 0.9999) = 4 → 9.5, 9.0, 8.5, 8.0, all in rows 0-1
    full = credit.build("entropy_fork").assign(b, adv, {E: ent}).loss_mask
    assert full[:2].sum() == 4 and full[2:].sum() == 0
    assert full[0, 3:].all() and full[1, 3:].all()
    # micro_batch_size 2: two chunks of N = 10 → k = int(2.0 + 0.9999) = 2 each
    micro = credit.build(
        "entropy_fork", {"scope": "micro_batch", "micro_batch_size": 2}
    ).assign(b, adv, {E: ent}).loss_mask
    assert micro[:2].sum() == 2 and micro[2:].sum() == 2
    assert micro[0, 4] and micro[1, 4] and micro[2, 4] and micro[3, 4]  # 9.0/9.5 and 0.5/0.55


def test_never_calls_torch_quantile(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("torch.quantile must not be used (fails above 2^24 elements)")

    monkeypatch.setattr(torch, "quantile", boom)
    monkeypatch.setattr(torch.Tensor, "quantile", boom)
    g = torch.Generator().manual_seed(0)
    B, T = 64, 512
    mask = torch.arange(T)[None] < torch.randint(1, T + 1, (B, 1), generator=g)
    ent = torch.rand(B, T, generator=g) * mask
    n = int(mask.sum())
    for opts in ({}, {"scope": "micro_batch", "micro_batch_size": 8}, {"normaliser": "trl"}):
        out = credit.build("entropy_fork", opts).assign(_batch(mask), torch.randn(B, generator=g), {E: ent})
        if "scope" not in opts and "normaliser" not in opts:
            assert int(out.loss_mask.sum()) == int(n * 0.2 + 0.9999)
            assert not (out.loss_mask & ~mask).any()


def test_options_are_validated_and_flags_truthful():
    for bad in ({"rho": 0.0}, {"rho": 1.5}, {"normaliser": "dapo"}, {"scope": "rank"}, {"scope": "micro_batch"}):
        with pytest.raises(ValueError):
            credit.build("entropy_fork", bad)
    cls = credit.get("entropy_fork")
    assert cls.needs == frozenset({E}) and cls.preserves_sign and not cls.preserves_mass
