"""opsd (docs/credit/opsd.md, sampled-token form): A_t = sg(log π_T(y_t) − log π_S(y_t))."""
import pytest
import torch

from gearlab import credit
from gearlab.core.batch import RolloutBatch
from gearlab.credit import Signal

TL, SL = Signal.TEACHER_LOGPROBS, Signal.LOGPROBS


def _batch(mask) -> RolloutBatch:
    return RolloutBatch.from_masks(mask)


MASK = [[1, 1, 1, 0], [1, 1, 0, 0]]
# masked positions hold junk on purpose: they must come out 0
TEACHER = torch.tensor([[-0.5, -1.0, -2.0, -7.0], [-0.125, -3.0, -7.0, -7.0]])
STUDENT = torch.tensor([[-1.0, -1.0, -0.5, -1.0], [-0.625, -1.0, -1.0, -1.0]])
# Δ = T − S: row 0 [.5, 0, −1.5, ·], row 1 [.5, −2, ·, ·]
DELTA = torch.tensor([[0.5, 0.0, -1.5, 0.0], [0.5, -2.0, 0.0, 0.0]])
SIG = {TL: TEACHER, SL: STUDENT}


def test_default_is_the_pure_log_ratio_and_ignores_the_reward():
    for adv in (torch.tensor([1.0, -1.0]), torch.zeros(2), torch.tensor([-3.0, 2.0])):
        out = credit.build("opsd").assign(_batch(MASK), adv, SIG)
        assert torch.equal(out.token_advantages, DELTA)
    # mean Δ over 5 tokens: (.5 + 0 − 1.5 + .5 − 2) / 5 = −0.5; |Δ| mean = 4.5/5; positive: 2/5
    assert out.metrics["opsd/delta_mean"] == pytest.approx(-0.5)
    assert out.metrics["opsd/delta_abs_mean"] == pytest.approx(0.9)
    assert out.metrics["opsd/frac_delta_positive"] == pytest.approx(0.4)


def test_clip_option():
    # clip 1.0: row 0 [.5, 0, −1, 0], row 1 [.5, −1, 0, 0]; 2 of 5 tokens clipped
    out = credit.build("opsd", {"clip": 1.0}).assign(_batch(MASK), torch.tensor([1.0, -1.0]), SIG)
    assert torch.equal(out.token_advantages, torch.tensor([[0.5, 0.0, -1.0, 0.0], [0.5, -1.0, 0.0, 0.0]]))
    assert out.metrics["opsd/frac_clipped"] == pytest.approx(0.4)


def test_coef_and_outcome_mix():
    # coef 2, outcome_coef 0.5, A = [1, −1]:
    # row 0: 2·[.5, 0, −1.5] + .5 = [1.5, .5, −2.5]; row 1: 2·[.5, −2] − .5 = [.5, −4.5]
    out = credit.build("opsd", {"coef": 2.0, "outcome_coef": 0.5}).assign(_batch(MASK), torch.tensor([1.0, -1.0]), SIG)
    assert torch.equal(out.token_advantages, torch.tensor([[1.5, 0.5, -2.5, 0.0], [0.5, -4.5, 0.0, 0.0]]))


def test_teacher_equal_to_student_gives_zero_and_empty_mask():
    out = credit.build("opsd").assign(_batch(MASK), torch.zeros(2), {TL: STUDENT, SL: STUDENT})
    assert torch.equal(out.token_advantages, torch.zeros(2, 4))
    out = credit.build("opsd").assign(
        _batch([[0, 0], [0, 0]]), torch.ones(2), {TL: torch.zeros(2, 2), SL: torch.zeros(2, 2)}
    )
    assert torch.equal(out.token_advantages, torch.zeros(2, 2))
    assert out.metrics["opsd/delta_mean"] == 0.0


def test_detached():
    sig = {TL: TEACHER.clone().requires_grad_(True), SL: STUDENT.clone().requires_grad_(True)}
    assert not credit.build("opsd").assign(_batch(MASK), torch.ones(2), sig).token_advantages.requires_grad


def test_teacher_settings_and_flags():
    a = credit.build("opsd")
    assert (a.teacher_mode, a.teacher_sync_every, a.teacher_context) == ("live", 0, "solution")
    a = credit.build("opsd", {"teacher_mode": "frozen", "teacher_context": "answer"})  # the source's fixed teacher θ₀
    assert (a.teacher_mode, a.teacher_sync_every, a.teacher_context) == ("frozen", 0, "answer")
    for bad in ({"clip": 0.0}, {"teacher_mode": "offline"}, {"teacher_context": "hint"}, {"teacher_sync_every": -1}):
        with pytest.raises(ValueError):
            credit.build("opsd", bad)
    cls = credit.get("opsd")
    assert cls.needs == frozenset({TL, SL})
    assert not cls.preserves_sign and not cls.preserves_mass and not cls.keeps_zero_groups
