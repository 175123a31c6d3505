"""Teacher weights by mode: live (no copy), frozen (re-synced every K iterations), EMA."""
import torch

from gearlab.credit import CreditAssigner, CreditOutput, Signal
from gearlab.trainer.teacher import Teacher


def _assigner(mode, every=0, ema=0.9):
    class A(CreditAssigner):
        needs = frozenset({Signal.TEACHER_LOGPROBS})
        teacher_mode, teacher_sync_every, teacher_ema = mode, every, ema

        def assign(self, batch, seq_advantages, signals):
            return CreditOutput(seq_advantages[:, None])

    return A()


def _bump(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)


def test_live_teacher_is_the_policy():
    policy = torch.nn.Linear(2, 2)
    assert Teacher(policy, _assigner("live")).model is None


def test_frozen_teacher_resyncs_every_k_iterations():
    policy = torch.nn.Linear(2, 2)
    t = Teacher(policy, _assigner("frozen", every=2))
    w0 = policy.weight.detach().clone()
    _bump(policy)
    t.after_iteration(1)
    assert torch.equal(t.model.weight, w0)  # not yet
    t.after_iteration(2)
    assert torch.equal(t.model.weight, policy.weight)
    assert not t.model.weight.requires_grad


def test_ema_teacher_moves_by_one_minus_decay():
    policy = torch.nn.Linear(2, 2)
    t = Teacher(policy, _assigner("ema", ema=0.9))
    w0 = policy.weight.detach().clone()
    _bump(policy)
    t.after_iteration(1)
    torch.testing.assert_close(t.model.weight, w0 + 0.1)  # 0.9 * w0 + 0.1 * (w0 + 1)


def test_teacher_state_round_trips():
    policy = torch.nn.Linear(2, 2)
    t = Teacher(policy, _assigner("frozen"))
    _bump(t.model)
    state = t.state_dict()
    t2 = Teacher(policy, _assigner("frozen"))
    t2.load_state_dict(state)
    assert torch.equal(t2.model.weight, t.model.weight)


def test_the_copy_follows_the_policy_to_its_device():
    """The copy is made before Lightning moves the policy (to a GPU in a real run): it must follow, for the
    teacher forward and for the EMA update alike (the meta device stands in for the GPU here)."""
    for mode in ("frozen", "ema"):
        policy = torch.nn.Linear(2, 2)
        t = Teacher(policy, _assigner(mode))
        policy.to("meta")
        assert t.model.weight.device.type == "meta"
        t.after_iteration(1)
        assert t.copy.weight.device.type == "meta"
