"""entropy_adv (docs/credit/entropy_adv.md): A_t = A + min(α·H_t, |A|/κ)."""
import pytest
import torch

from gearlab import credit
from gearlab.core.batch import RolloutBatch
from gearlab.credit import Signal

E = Signal.ENTROPY


def _batch(mask) -> RolloutBatch:
    return RolloutBatch.from_masks(mask)


MASK = [[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
ENT = torch.tensor([[0.5, 2.0, 0.0, 9.0], [0.25, 5.0, 1.0, 9.0], [3.0, 3.0, 3.0, 3.0]])
ADV = torch.tensor([1.0, -1.0, 0.0])


def test_hand_computed_values_default_alpha_kappa():
    # α = 0.4, κ = 2 → cap |A|/κ = 0.5 for |A| = 1
    # row 0 (A = +1): αH = [.2, .8, 0]   → ψ = [.2, .5, 0]   → A_t = [1.2, 1.5, 1.0]
    # row 1 (A = −1): αH = [.1, 2.0, .4] → ψ = [.1, .5, .4]  → A_t = [−.9, −.5, −.6]
    # row 2 (A = 0):  cap 0 → ψ = 0 → all 0 whatever H is
    out = credit.build("entropy_adv").assign(_batch(MASK), ADV, {E: ENT})
    want = torch.tensor([[1.2, 1.5, 1.0, 0.0], [-0.9, -0.5, -0.6, 0.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(out.token_advantages, want)
    # ψ over the 6 active tokens: (.2+.5+0+.1+.5+.4)/6 = 1.7/6; capped where αH ≥ cap: (0,1), (1,1) → 2/6
    assert out.metrics["entropy_adv/psi_mean"] == pytest.approx(1.7 / 6)
    assert out.metrics["entropy_adv/frac_capped"] == pytest.approx(2 / 6)


def test_other_alpha_kappa():
    # α = 1, κ = 4, A = [2, −2] → cap = 0.5; H = [0.3, 0.7] → ψ = [0.3, 0.5]
    # row 0: [2.3, 2.5]; row 1: [−1.7, −1.5]
    out = credit.build("entropy_adv", {"alpha": 1.0, "kappa": 4.0}).assign(
        _batch([[1, 1], [1, 1]]), torch.tensor([2.0, -2.0]), {E: torch.tensor([[0.3, 0.7], [0.3, 0.7]])})
    torch.testing.assert_close(out.token_advantages, torch.tensor([[2.3, 2.5], [-1.7, -1.5]]))


def test_all_zero_advantages_stay_zero_and_empty_mask():
    out = credit.build("entropy_adv").assign(_batch(MASK), torch.zeros(3), {E: ENT})
    assert torch.equal(out.token_advantages, torch.zeros(3, 4))
    out = credit.build("entropy_adv").assign(
        _batch([[0, 0], [0, 0]]), torch.tensor([1.0, -1.0]), {E: torch.zeros(2, 2)}
    )
    assert torch.equal(out.token_advantages, torch.zeros(2, 2))
    assert out.metrics["entropy_adv/entropy_mean"] == 0.0


def test_sign_never_flips_and_bonus_bounded():
    g = torch.Generator().manual_seed(0)
    B, T = 16, 32
    adv = torch.randn(B, generator=g)
    ent = torch.rand(B, T, generator=g) * 10
    mask = torch.rand(B, T, generator=g) > 0.2
    out = credit.build("entropy_adv").assign(_batch(mask), adv, {E: ent * mask}).token_advantages
    a = adv[:, None].expand(B, T)
    assert (torch.sign(out[mask]) == torch.sign(a[mask])).all()
    psi = (out - a)[mask]
    assert (psi >= 0).all() and (psi <= a[mask].abs() / 2 + 1e-6).all()
    assert (out[~mask] == 0).all()


def test_slightly_negative_entropy_is_clamped():
    out = credit.build("entropy_adv").assign(_batch([[1]]), torch.tensor([1.0]), {E: torch.tensor([[-1e-7]])})
    assert out.token_advantages.item() == 1.0  # ψ = min(0.4·0, 0.5) = 0


def test_options_validated_and_flags():
    for bad in ({"kappa": 1.0}, {"kappa": 0.5}, {"alpha": 0.0}, {"alpha": -1.0}):
        with pytest.raises(ValueError):
            credit.build("entropy_adv", bad)
    cls = credit.get("entropy_adv")
    assert cls.needs == frozenset({E}) and cls.preserves_sign and not cls.preserves_mass
