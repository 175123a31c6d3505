"""Every registered assigner (bundled and plug-ins) passes the contract kit; the kit itself can fail."""
import pytest
import torch

from gearlab import credit
from gearlab.credit.contract import assert_contract, check_assigner
from gearlab.credit import CreditAssigner, CreditOutput, Signal


@pytest.mark.parametrize("name", credit.available())
def test_registered_assigner_keeps_its_contract(name):
    assert_contract(name)


class _Leaky(CreditAssigner):
    needs = frozenset({Signal.ENTROPY})
    preserves_sign = True

    def assign(self, batch, seq_advantages, signals):
        # three bugs: credit on padding, an unused... no: entropy used with a sign flip, and no detach
        adv = seq_advantages[:, None] - signals[Signal.ENTROPY]
        return CreditOutput(adv + 0.1)


class _Random(CreditAssigner):
    def assign(self, batch, seq_advantages, signals):
        return CreditOutput(seq_advantages[:, None] * torch.rand(batch.response_ids.shape) * batch.response_mask)


def test_the_kit_catches_broken_assigners():
    failed = {c.name for c in check_assigner(_Leaky) if not c.ok}
    assert {"no credit on masked tokens", "zero-advantage sequences stay zero", "sign preserved",
            "no gradient through signals"} <= failed
    failed = {c.name for c in check_assigner(_Random) if not c.ok}
    assert "deterministic" in failed
