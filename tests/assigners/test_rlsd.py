"""rlsd (docs/credit/rlsd.md): A·((1−λ) + λ·clip(exp(sign(A)·Δ), 1±ε)), λ decaying to 0 (then plain GRPO)."""
import io
import math

import pytest
import torch

from gearlab import credit
from gearlab.core.batch import RolloutBatch
from gearlab.credit import Signal

TL, SL = Signal.TEACHER_LOGPROBS, Signal.LOGPROBS


def _batch(mask) -> RolloutBatch:
    return RolloutBatch.from_masks(mask)


MASK = [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]
DELTA = torch.tensor([[0.1, -0.1, 1.0, -1.0], [0.1, -1.0, 0.0, 5.0], [0.3, 0.3, 0.0, 0.0]])
STUDENT = torch.full((3, 4), -1.0)
SIG = {TL: STUDENT + DELTA, SL: STUDENT}
ADV = torch.tensor([2.0, -1.0, 0.0])
GRPO = ADV[:, None] * torch.tensor(MASK, dtype=torch.float32)


def _lam_at(a, steps_done: int) -> float:
    a.on_step_end(steps_done)
    return a.current_lambda()


def test_hand_computed_reweighting_constant_lambda():
    # λ = 0.5 held constant (decay_steps = 0), ε = 0.2
    # row 0, A = +2: w = exp(Δ) = [e^.1, e^-.1, e, e^-1] → clip [1.10517, 0.904837, 1.2, 0.8]
    #   factor = .5 + .5·clip = [1.052585, 0.952419, 1.1, 0.9] → A_t = 2·factor = [2.10517, 1.904837, 2.2, 1.8]
    # row 1, A = −1: w = exp(−Δ) = [e^-.1, e, 1, ·] → clip [0.904837, 1.2, 1.0] → factor [0.952419, 1.1, 1.0]
    #   → A_t = [−0.952419, −1.1, −1.0, 0] (the masked Δ = 5 is ignored)
    # row 2, A = 0: sign 0 → w = 1, A_t = 0
    out = credit.build("rlsd", {"decay_steps": 0}).assign(_batch(MASK), ADV, SIG)
    f = lambda d: 0.5 + 0.5 * min(max(math.exp(d), 0.8), 1.2)  # noqa: E731
    want = torch.tensor([[2 * f(0.1), 2 * f(-0.1), 2.2, 1.8], [-f(-0.1), -1.1, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(out.token_advantages, want)
    assert want[0, 0].item() == pytest.approx(2.10517, abs=1e-5) and want[1, 0].item() == pytest.approx(
        -0.952419, abs=1e-6
    )
    assert out.metrics["rlsd/lambda"] == 0.5
    # 9 valid tokens; w < 0.8: row 0 t3 (e^-1) → 1/9; w > 1.2: row 0 t2 (e), row 1 t1 (e) → 2/9
    assert out.metrics["rlsd/clip_low_frac"] == pytest.approx(1 / 9)
    assert out.metrics["rlsd/clip_high_frac"] == pytest.approx(2 / 9)


def test_default_schedule_decays_to_plain_grpo():
    # defaults λ = 0.5, decay over 60, no warm-up; g = steps_done + 1 (the authors' 1-based global step)
    a = credit.build("rlsd")
    assert a.current_lambda() == pytest.approx(0.5 * 59 / 60)  # first iteration, g = 1
    assert _lam_at(a, 29) == pytest.approx(0.25)  # g = 30: 0.5·(1 − 30/60)
    assert _lam_at(a, 58) == pytest.approx(0.5 / 60)  # g = 59
    assert _lam_at(a, 59) == 0.0  # g = 60: 60th iteration is plain GRPO
    # exactly GRPO afterwards, even with non-finite teacher gaps
    wild = {TL: torch.full((3, 4), float("inf")), SL: STUDENT}
    for s in (59, 60, 1000):
        a.on_step_end(s)
        out = a.assign(_batch(MASK), ADV, wild)
        assert torch.equal(out.token_advantages, GRPO)


def test_simulated_training_loop_matches_module_calls():
    # module.py: assign(...) at iteration it, then on_step_end(it + 1)
    a = credit.build("rlsd", {"lam": 0.5, "decay_steps": 4})
    lams = []
    for it in range(6):
        lams.append(a.current_lambda())
        a.on_step_end(it + 1)
    # g = 1..6: 0.5·(1 − g/4)⁺ = [.375, .25, .125, 0, 0, 0]
    assert lams == pytest.approx([0.375, 0.25, 0.125, 0.0, 0.0, 0.0])


def test_warmup_then_decay_and_total_steps_fallback():
    a = credit.build("rlsd", {"lam": 0.5, "warmup_steps": 4, "decay_steps": 10})
    assert _lam_at(a, 0) == pytest.approx(0.125)  # g = 1 < 4: 0.5·1/4
    assert _lam_at(a, 3) == pytest.approx(0.5)  # g = 4: decay progress 0
    assert _lam_at(a, 8) == pytest.approx(0.25)  # g = 9: 0.5·(1 − 5/10)
    assert _lam_at(a, 13) == 0.0  # g = 14
    a = credit.build("rlsd", {"decay_steps": 0})
    assert _lam_at(a, 500) == 0.5  # decay_steps 0 = constant λ (as in the authors' code)
    a = credit.build("rlsd", {"decay_steps": None})
    a.setup(seed=0, total_steps=20, task=None)
    assert _lam_at(a, 9) == pytest.approx(0.25)  # g = 10: 0.5·(1 − 10/20)


def test_state_dict_round_trip_resumes_exactly():
    a = credit.build("rlsd", {"decay_steps": None})
    a.setup(seed=0, total_steps=40, task=None)
    a.on_step_end(17)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)  # checkpoint-serialisable
    buf.seek(0)
    b = credit.build("rlsd", {"decay_steps": None})
    b.load_state_dict(torch.load(buf))
    assert b.current_lambda() == a.current_lambda() == pytest.approx(0.5 * (1 - 18 / 40))
    assert torch.equal(
        a.assign(_batch(MASK), ADV, SIG).token_advantages, b.assign(_batch(MASK), ADV, SIG).token_advantages
    )
    c = credit.build("rlsd")
    c.load_state_dict({})  # an old checkpoint without assigner state starts from step 0
    assert c.current_lambda() == pytest.approx(0.5 * 59 / 60)


def test_negative_only_and_zero_advantages():
    out = credit.build("rlsd", {"decay_steps": 0, "negative_only": True}).assign(_batch(MASK), ADV, SIG)
    assert torch.equal(out.token_advantages[0], GRPO[0])  # A > 0 row untouched
    torch.testing.assert_close(out.token_advantages[1, :3], torch.tensor([-(0.5 + 0.5 * math.exp(-0.1)), -1.1, -1.0]))
    out = credit.build("rlsd", {"decay_steps": 0}).assign(_batch(MASK), torch.zeros(3), SIG)
    assert torch.equal(out.token_advantages, torch.zeros(3, 4))
    out = credit.build("rlsd").assign(_batch([[0, 0]]), torch.ones(1), {TL: torch.zeros(1, 2), SL: torch.zeros(1, 2)})
    assert torch.equal(out.token_advantages, torch.zeros(1, 2))


def test_sign_kept_and_factor_bounded_under_extreme_gaps():
    g = torch.Generator().manual_seed(0)
    B, T = 16, 24
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    sig = {TL: torch.randn(B, T, generator=g) * 50 * mask, SL: torch.zeros(B, T)}
    out = credit.build("rlsd", {"lam": 1.0, "decay_steps": 0}).assign(_batch(mask), adv, sig).token_advantages
    ratio = out[mask] / adv[:, None].expand(B, T)[mask]
    assert (ratio >= 0.8 - 1e-6).all() and (ratio <= 1.2 + 1e-6).all()  # λ = 1: factor = clip(w) ∈ [1−ε, 1+ε]
    assert (out[~mask] == 0).all()


def test_teacher_settings_options_and_flags():
    a = credit.build("rlsd")
    assert (a.teacher_mode, a.teacher_sync_every, a.teacher_context) == ("frozen", 10, "answer")
    assert credit.build("rlsd", {"teacher_sync_every": 20}).teacher_sync_every == 20
    for bad in ({"lam": 1.5}, {"lam": -0.1}, {"clip_eps": 1.0}, {"decay_steps": -1}, {"warmup_steps": -2}):
        with pytest.raises(ValueError):
            credit.build("rlsd", bad)
    cls = credit.get("rlsd")
    assert cls.needs == frozenset({TL, SL}) and cls.preserves_sign and not cls.preserves_mass
