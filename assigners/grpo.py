"""Plain GRPO credit: every generated token of a response gets its sequence advantage.

Source: verl ``compute_grpo_outcome_advantage`` / TRL GRPOTrainer (docs/grpo.md#group-advantages): A_{i,t} = A_i · \
m_{i,t}.
"""
from __future__ import annotations

from torch import Tensor

from gearlab.core.batch import RolloutBatch
from gearlab.credit import CreditAssigner, CreditOutput, Signal, register


@register("grpo")
class GRPOAssigner(CreditAssigner):
    needs = frozenset()
    preserves_sign = True  # A_i on every generated token: its sign, and Σ_t = N_i · A_i
    preserves_mass = True

    def assign(self, batch: RolloutBatch, seq_advantages: Tensor, signals: dict[Signal, Tensor]) -> CreditOutput:
        mask = batch.response_mask
        adv = seq_advantages[:, None].to(mask.device).float() * mask.float()
        return CreditOutput(token_advantages=adv)
