"""OAR bi-level reshaping (docs/credit/oar.md#bi-level-reshaping) and the oar_g / oar_p assigners."""
import math

import pytest
import torch
import yaml

from gearlab import credit
from gearlab.core.batch import RolloutBatch
from gearlab.credit import Signal
from assigners.oar import _row_quantile, bilevel_weights


def _sal(vals):
    """Saliencies whose log1p are exactly ``vals``."""
    return torch.tensor([[math.expm1(v) for v in vals]], dtype=torch.float32)


def test_bilevel_hand_computed():
    # ŝ = log1p(s) = [0, 1, 2, 3] on 4 reasoning tokens; position 4 is not reasoning.
    # n = (ŝ − 0) / 3 = [0, 1/3, 2/3, 1]; q = 0.5 → h = 0.5·(4−1) = 1.5 → τ = (1/3 + 2/3)/2 = 0.5
    # low  (n < τ): max(n/τ, 0.1): 0 → max(0, 0.1) = 0.1;  1/3 → (1/3)/0.5 = 2/3
    # high (n ≥ τ): 1 + β(n − τ)/(1 − τ): 2/3 → 1 + (1/6)/(1/2) = 4/3;  1 → 1 + 0.5/0.5 = 2
    s = torch.cat([_sal([0.0, 1.0, 2.0, 3.0]), torch.tensor([[123.0]])], dim=1)
    m = torch.tensor([[True, True, True, True, False]])
    w = bilevel_weights(s, m, q=0.5, beta=1.0, floor=0.1, sum_to_L=False)
    torch.testing.assert_close(w, torch.tensor([[0.1, 2 / 3, 4 / 3, 2.0, 1.0]]), rtol=0, atol=1e-6)
    # sum_to_L: Σ = 0.1 + 2/3 + 4/3 + 2 = 4.1 → × 4/4.1; the non-reasoning weight stays 1
    w = bilevel_weights(s, m, q=0.5, beta=1.0, floor=0.1, sum_to_L=True)
    torch.testing.assert_close(w[:, :4], torch.tensor([[0.1, 2 / 3, 4 / 3, 2.0]]) * (4 / 4.1), rtol=0, atol=1e-6)
    assert w[0, 4] == 1.0
    # β = 2, q = 0.25 → h = 0.75 → τ = 0 + 0.75·(1/3) = 0.25; floor 0.5
    # low: 0 → max(0, 0.5) = 0.5;  high: 1/3 → 1 + 2(1/12)/(3/4) = 1 + 2/9;  2/3 → 1 + 2(5/12)/(3/4) = 1 + 10/9;  1 → 1
    # + 2 = 3
    w = bilevel_weights(s, m, q=0.25, beta=2.0, floor=0.5, sum_to_L=False)
    torch.testing.assert_close(w[:, :4], torch.tensor([[0.5, 1 + 2 / 9, 1 + 10 / 9, 3.0]]), rtol=0, atol=1e-6)


def test_constant_single_and_empty_reasoning_give_ones():
    m = torch.tensor([[True] * 5 + [False], [False, False, True, False, False, False], [False] * 6])
    s = torch.tensor([[0.7] * 6, [5.0] * 6, [1.0] * 6])  # constant row, one-token row, no reasoning
    for sum_to_L in (True, False):
        w = bilevel_weights(s, m, sum_to_L=sum_to_L)
        torch.testing.assert_close(w, torch.ones(3, 6))


def test_rows_are_independent_and_quantile_is_per_sequence():
    # the released code's drifting threshold would make row 2's result depend on row 1's τ
    g = torch.Generator().manual_seed(0)
    s = torch.rand(4, 9, generator=g) * 3
    m = torch.rand(4, 9, generator=g) > 0.3
    w = bilevel_weights(s, m, q=0.3)
    for i in range(4):
        torch.testing.assert_close(w[i : i + 1], bilevel_weights(s[i : i + 1], m[i : i + 1], q=0.3))


def test_row_quantile_matches_torch_quantile():
    g = torch.Generator().manual_seed(1)
    v = torch.rand(6, 11, generator=g)
    m = torch.rand(6, 11, generator=g) > 0.4
    m[0] = False
    m[1] = False
    m[1, 3] = True
    for q in (0.0, 0.3, 0.5, 0.9, 1.0):
        tau = _row_quantile(v, m, q)
        for i in range(6):
            ref = torch.quantile(v[i][m[i]], q) if m[i].any() else torch.tensor(0.0)
            torch.testing.assert_close(tau[i], ref)


def _batch(B=4, T=8):
    rmask = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate([8, 6, 3, 1][:B]):
        rmask[i, :n] = True
    return RolloutBatch(prompt_ids=torch.ones(B, 2, dtype=torch.long), prompt_mask=torch.ones(B, 2, dtype=torch.long),
                        response_ids=torch.ones(B, T, dtype=torch.long), response_mask=rmask,
                        group_ids=torch.zeros(B, dtype=torch.long), rewards=torch.zeros(B))


@pytest.mark.parametrize("name,sig", [("oar_g", Signal.INPUT_GRAD_SALIENCY), ("oar_p", Signal.PERTURBATION_SALIENCY)])
def test_assigner_mass_sign_and_true_offset(name, sig):
    b = _batch()
    reasoning = torch.zeros(4, 8)
    reasoning[0, 2:6] = 1  # reasoning not at the start of the response (e.g. after a preamble)
    reasoning[1, :4] = 1
    reasoning[2, :1] = 1
    sal = torch.rand(4, 8, generator=torch.Generator().manual_seed(3)) * reasoning
    A = torch.tensor([1.5, -0.5, 2.0, -1.0])
    a = credit.build(name)
    assert a.needs == frozenset({sig, Signal.REASONING_MASK})
    assert a.preserves_sign and a.preserves_mass
    out = a.assign(b, A, {sig: sal, Signal.REASONING_MASK: reasoning}).token_advantages
    m = b.response_mask.float()
    torch.testing.assert_close(out.sum(-1), A * m.sum(-1))  # Σ_t A_{i,t} = N_i · A_i
    nz = out != 0
    assert (torch.sign(out)[nz] == torch.sign(A)[:, None].expand_as(out)[nz]).all()
    assert (out[~b.response_mask] == 0).all()
    # weights live on the true reasoning positions 2..5 of row 0; the rest of the row keeps A_i
    torch.testing.assert_close(out[0, [0, 1, 6, 7]], torch.full((4,), 1.5))
    w = bilevel_weights(sal, reasoning.bool())
    torch.testing.assert_close(out[0, 2:6], 1.5 * w[0, 2:6])
    assert (out[0, 2:6] != 1.5).any()


def test_no_sum_to_L_is_not_mass_preserving_but_keeps_sign():
    a = credit.build("oar_g", {"sum_to_L": False})
    assert not a.preserves_mass and a.preserves_sign
    assert credit.get("oar_g").preserves_mass  # class promise = default options


def test_options_from_yaml_and_signal_options():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "conf" / "assigner"
    g = yaml.safe_load((root / "oar_g.yaml").read_text())
    p = yaml.safe_load((root / "oar_p.yaml").read_text())
    ag, ap = credit.build(g["name"], g["options"]), credit.build(p["name"], p["options"])
    assert ag.signal_options() == {"pfinal_mode": "answer_mean", "answer_anchor": "value", "saliency_noise": 1e-3}
    assert ap.signal_options() == {"pfinal_mode": "last", "answer_anchor": "value",
                                   "perturb_stride": 1, "perturb_max_positions": 64, "perturb_kv_share": False}
    assert credit.build("oar_p", {"perturb_kv_share": True}).signal_options()["perturb_kv_share"] is True
    with pytest.raises(ValueError):
        credit.build("oar_g", {"pfinal_mode": "nope"})
    with pytest.raises(ValueError):
        credit.build("oar_p", {"saliency_noise": 1e-3})


@pytest.mark.parametrize("name,pfinal_mode", [("oar_g", "answer_mean"), ("oar_p", "last")])
def test_defaults_are_the_released_ones_and_the_old_ones_stay_reachable(name, pfinal_mode):
    """Defaults = the authors' released README (q 0.25, beta 1.0; answer_mean for OAR-G, last for OAR-P); gearlab's
    earlier defaults (q 0.5, last for both) through the label NAME:q=0.5,pfinal_mode=last or the NAME_legacy variant."""
    from gearlab.credit.methods import build_method, method_spec

    a = credit.build(name)
    assert (
        a.q, a.beta, a.floor, a.sum_to_L, a.pfinal_mode, a.answer_anchor
    ) == (0.25, 1.0, 0.1, True, pfinal_mode, "value")
    assert build_method(name).q == 0.25 and build_method(name).pfinal_mode == pfinal_mode  # the YAML sets none
    for label in (f"{name}:q=0.5,pfinal_mode=last", f"{name}_legacy"):
        old = build_method(label)
        assert type(old) is type(a) and old.q == 0.5 and old.pfinal_mode == "last" and old.beta == 1.0
    assert method_spec(f"{name}_legacy").base == name
    # the assigner's weights follow q: τ is the 0.25-quantile by default
    s = _sal([0.0, 1.0, 2.0, 3.0])
    m = torch.ones(1, 4, dtype=torch.bool)
    b = RolloutBatch(prompt_ids=torch.ones(1, 2, dtype=torch.long), prompt_mask=torch.ones(1, 2, dtype=torch.long),
                     response_ids=torch.ones(1, 4, dtype=torch.long), response_mask=m,
                     group_ids=torch.zeros(1, dtype=torch.long), rewards=torch.zeros(1))
    sig = a.needs - {Signal.REASONING_MASK}
    for obj, q in ((a, 0.25), (build_method(f"{name}_legacy"), 0.5)):
        out = obj.assign(
            b, torch.tensor([1.0]), {**{k: s for k in sig}, Signal.REASONING_MASK: m.float()}
        ).token_advantages
        torch.testing.assert_close(out, bilevel_weights(s, m, q=q))
