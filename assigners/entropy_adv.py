"""Entropy-based advantage shaping: a clipped, detached entropy bonus added to every token's advantage.

Method: Cheng et al., "Reasoning with Exploration: An Entropy Perspective" (arXiv 2506.14758),
docs/credit/entropy_adv.md.

    ψ_{i,t} = min( α · sg(H_{i,t}), |A_i| / κ ),   α > 0, κ > 1          [3P, consistent with the abstract]
    A_{i,t} = (A_i + ψ_{i,t}) · m_{i,t}                                   (GRPO broadcast A_i)   [SRC abstract]

Properties: 0 ≤ ψ ≤ |A_i|/κ < |A_i|, so the sign of A_i never flips; A_i = 0 gives ψ = 0, so tokens of
zero-advantage (zero-std) groups stay exactly 0. High-entropy tokens get a larger advantage in
positive responses and a softer penalty in negative ones.

Provenance of choices:
  * α = 0.4, κ = 2: [PROPOSED] unverified starting point (the paper's values were not found); options.
  * H_t from π_old (Signal.ENTROPY, temperature-scaled, nats): [PROPOSED]; the source does not say
    old or current policy.
  * H_t is clamped at 0 before use [PROPOSED] (guards a float-rounding -1e-7 from breaking ψ ≥ 0).
"""
from __future__ import annotations

from dataclasses import dataclass
import torch
from torch import Tensor

from gearlab.core.batch import RolloutBatch
from gearlab.credit import CreditAssigner, CreditOutput, Signal, register
from gearlab.credit.options import option


@dataclass
class EntropyAdvOptions:
    alpha: float = option(0.4, "entropy bonus scale α [PROPOSED]", lo=0.0, lo_open=True)
    kappa: float = option(2.0, "cap |A|/κ on the bonus; κ > 1 keeps the sign of A [PROPOSED]", lo=1.0, lo_open=True)


@register("entropy_adv")
class EntropyAdvantageAssigner(CreditAssigner):
    needs = frozenset({Signal.ENTROPY})
    preserves_sign = True  # |ψ| ≤ |A|/κ < |A|
    preserves_mass = False  # ψ ≥ 0 adds mass whenever A ≠ 0 and H > 0

    Options = EntropyAdvOptions

    def chunk_local(self, rows: int) -> bool:
        return True  # ψ_{i,t} depends on row i alone; no loss mask

    def assign(self, batch: RolloutBatch, seq_advantages: Tensor, signals: dict[Signal, Tensor]) -> CreditOutput:
        mask = batch.response_mask  # [B, T] bool
        m = mask.float()
        a = seq_advantages.to(mask.device).float()[:, None].expand_as(m)  # [B, T]
        ent = signals[Signal.ENTROPY].to(mask.device).float().detach().clamp_min(0.0)  # [B, T]
        raw = self.alpha * ent
        cap = a.abs() / self.kappa
        psi = torch.minimum(raw, cap)  # [B, T], 0 where A = 0
        adv = (a + psi) * m
        active = mask & (a != 0)
        n_act = int(active.sum())
        metrics = {
            "entropy_adv/psi_mean": float(psi[active].mean()) if n_act else 0.0,
            "entropy_adv/frac_capped": float((raw[active] >= cap[active]).float().mean()) if n_act else 0.0,
            "entropy_adv/entropy_mean": float(ent[mask].mean()) if bool(mask.any()) else 0.0,
        }
        return CreditOutput(token_advantages=adv.detach(), metrics=metrics)
