"""SHEAR — span-level hidden-state Wasserstein distances scale GRPO's token advantages (arXiv 2604.23318;
docs/credit/shear.md). A **reconstruction**: no code was released, and the steps follow third-party restatements
of the paper's Algorithm 1 (the weights: gearlab.signals.span_wasserstein).

    A_{i,t} = A_i · ω_{i,t} · m_{i,t}      ω ≥ 0: the token's spans' distance to the group's other outcome, in units
                                           of the group's mean hidden-state norm; 1 in groups with one outcome

The weights are used as they come (the restatements mention no clipping or renormalisation), so SHEAR also changes
the step size against GRPO: ω ~ 0.2–1.5 in the paper's figures.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from gearlab.core.batch import RolloutBatch
from gearlab.credit import CreditAssigner, CreditOutput, register
from gearlab.credit.options import option

SPAN_WASSERSTEIN = "span_wasserstein"  # gearlab.signals.span_wasserstein


@dataclass
class SHEAROptions:
    span_len: int = option(100, "tokens per span [3P: the paper's default]", lo=1)
    stride: int = option(25, "tokens between span starts [3P]", lo=1)
    eps_relative: float = option(0.02, "Sinkhorn's entropic regularisation in units of the group's mean hidden-state "
                                       "norm [PROPOSED: the paper reports only eps·log n ≈ 20.8]", lo=0.0, lo_open=True)
    sinkhorn_iters: int = option(200, "at most this many Sinkhorn iterations [PROPOSED]", lo=1)
    correct_threshold: float = option(0.5, "a response is correct when its reward is above this [PROPOSED: the "
                                           "paper's rewards are 0/1]")


@register("shear")
class SHEARAssigner(CreditAssigner):
    """SHEAR: A_i times the span-level Wasserstein weight of each token (docs/credit/shear.md)."""

    needs = frozenset({SPAN_WASSERSTEIN})
    preserves_sign = True  # ω ≥ 0

    Options = SHEAROptions

    def signal_options(self) -> dict[str, Any]:
        return {"span_len": self.span_len, "stride": self.stride, "eps_relative": self.eps_relative,
                "sinkhorn_iters": self.sinkhorn_iters, "correct_threshold": self.correct_threshold}

    def assign(self, batch: RolloutBatch, seq_advantages: Tensor, signals: dict[Any, Tensor]) -> CreditOutput:
        m = batch.response_mask
        w = signals[SPAN_WASSERSTEIN].detach().to(m.device).float() * m.float()
        adv = seq_advantages.to(m.device).float()[:, None] * w
        wr = w[m]
        metrics = {"weight_mean": float(wr.mean()), "weight_max": float(wr.max())} if wr.numel() else {}
        return CreditOutput(token_advantages=adv, metrics=metrics)
