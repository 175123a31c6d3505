"""OAR — Outcome-grounded Advantage Reshaping (Li et al., arXiv 2601.07408; docs/credit/oar.md).

Each reasoning token gets a weight from its saliency for the outcome distribution (OAR-G: input
gradient × embedding, OAR-P: counterfactual masking; computed in gearlab.saliency), turned into
weights by the bi-level reshaping (docs/credit/oar.md#bi-level-reshaping); A_{i,t} = A_i · w_t · m_t, with w = 1 \
outside the
reasoning span. The weights are positive, so signs are kept; with ``sum_to_L`` the reasoning
weights sum to the number L of reasoning tokens, so Σ_t A_{i,t} = N_i · A_i.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gearlab.core.batch import RolloutBatch
from gearlab.credit import CreditAssigner, CreditOutput, Signal, register
from gearlab.credit.options import option
from gearlab.signals.saliency import ANCHORS, PFINAL_MODES

__all__ = ["bilevel_weights", "OARGAssigner", "OARPAssigner"]


def _row_quantile(values: Tensor, mask: Tensor, q: float) -> Tensor:
    """Per-row q-quantile of ``values`` over ``mask`` (linear interpolation between order statistics,
    as ``torch.quantile``'s default), by one sort; rows with an empty mask give 0. [B, T] → [B]."""
    n = mask.sum(-1)
    srt = values.masked_fill(~mask, float("inf")).sort(dim=-1).values
    h = q * (n - 1).clamp(min=0).to(values.dtype)
    lo = h.floor().long()
    hi = torch.minimum(lo + 1, (n - 1).clamp(min=0))
    v_lo = srt.gather(-1, lo[:, None]).squeeze(-1)
    v_hi = srt.gather(-1, hi[:, None]).squeeze(-1)
    tau = v_lo + (h - lo.to(values.dtype)) * (v_hi - v_lo)
    return torch.where(n > 0, tau, torch.zeros_like(tau))


def bilevel_weights(saliency: Tensor, reasoning_mask: Tensor, *, q: float = 0.25, beta: float = 1.0,
                    floor: float = 0.1, sum_to_L: bool = True) -> Tensor:
    """Bi-level reshaping weights (docs/credit/oar.md#bi-level-reshaping) [B, T] float32; 1.0 outside the reasoning \
span.

    Per sequence, over its L reasoning tokens: ŝ = log1p(s) (s clamped at 0); n = min-max
    normalised ŝ (range taken as 1 when ŝ is constant, so n = 0); τ = the q-quantile of n;
    n < τ: w = max(n / (τ + 1e-8), floor) (noise suppression); otherwise
    w = 1 + β (n − τ) / (1 − τ + 1e-8) (signal boosting). ``sum_to_L`` rescales the reasoning
    weights to sum to L (ones if their sum is ≤ 0).

    τ uses the per-sequence quantile level q. The released code instead overwrites its threshold
    variable with the first sequence's τ, so later sequences use the previous τ as quantile level
    (docs/credit/oar.md#the-released-threshold-drift); that drift is deliberately not reproduced.
    """
    m = reasoning_mask.bool()
    s = saliency.float().clamp(min=0.0).log1p()
    big = torch.finfo(s.dtype).max
    lo = s.masked_fill(~m, big).amin(-1, keepdim=True)
    hi = s.masked_fill(~m, -big).amax(-1, keepdim=True)
    rng = hi - lo
    rng = torch.where(rng > 0, rng, torch.ones_like(rng))
    n = ((s - lo) / rng).masked_fill(~m, 0.0)
    tau = _row_quantile(n, m, q)[:, None]
    low = torch.clamp(n / (tau + 1e-8), min=floor)
    high = 1.0 + beta * (n - tau) / (1.0 - tau + 1e-8)
    w = torch.where(n < tau, low, high)
    if sum_to_L:
        L = m.sum(-1, keepdim=True).float()
        tot = (w * m).sum(-1, keepdim=True)
        w = torch.where(tot > 0, w * L / torch.where(tot > 0, tot, torch.ones_like(tot)), torch.ones_like(w))
    return torch.where(m, w, torch.ones_like(w))


@dataclass
class OAROptions:
    """Options shared by OAR-G and OAR-P (docs/credit/oar.md#options). Defaults are the released README's
    (q = 0.25, beta = 1.0; pfinal_mode per method); gearlab's earlier q = 0.5 / "last" stay reachable as options."""

    q: float = option(0.25, "quantile level of the per-sequence saliency threshold", lo=0.0, hi=1.0)
    beta: float = option(1.0, "strength of the bi-level reshaping", lo=0.0)
    floor: float = option(0.1, "smallest weight of a low-saliency reasoning token", lo=0.0)
    sum_to_L: bool = option(True, "rescale reasoning weights to sum to the reasoning length (mass preserving)")
    pfinal_mode: str = option("last", "which answer-token probability the saliency follows", choices=PFINAL_MODES)
    answer_anchor: str = option("value", "where the final answer starts", choices=ANCHORS)


@dataclass
class OARGOptions(OAROptions):
    # the released default of OAR-G (OAR-P keeps "last")
    pfinal_mode: str = option(
        "answer_mean", "which answer-token probability the saliency follows", choices=PFINAL_MODES
    )
    saliency_noise: float = option(1e-3,
                                   "embedding noise of the input-gradient saliency (> 0: at 0 the gradient vanishes)",
                                   lo=0.0, lo_open=True)


@dataclass
class OARPOptions(OAROptions):
    perturb_stride: int = option(1, "perturb every k-th reasoning position", lo=1)
    perturb_max_positions: int = option(64, "at most this many perturbed copies per response (0 = no cap)", lo=0)
    perturb_kv_share: bool = option(False, "score each perturbed copy from the clean KV cache of its unchanged prefix "
                                           "(same values up to rounding; faster on a CPU, slower on an H100)")


class _OARBase(CreditAssigner):
    """Shared reshaping; subclasses set ``needs`` and the saliency signal."""

    saliency_signal: Signal
    preserves_sign = True  # w > 0 (floor > 0) or A_{i,t} = 0
    preserves_mass = True  # with sum_to_L (set per instance below)
    ignores_zero_rows = True  # each row's weights come from its own saliency alone, and A_i = 0 gives 0

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.preserves_mass = self.sum_to_L

    def signal_options(self) -> dict[str, Any]:
        # the noise seed ("seed") is the caller's: the training loop passes a per-iteration seed
        return {"pfinal_mode": self.pfinal_mode, "answer_anchor": self.answer_anchor}

    def assign(self, batch: RolloutBatch, seq_advantages: Tensor, signals: dict[Signal, Tensor]) -> CreditOutput:
        resp = batch.response_mask.bool()
        reasoning = signals[Signal.REASONING_MASK].detach().to(resp.device).bool() & resp
        sal = signals[self.saliency_signal].detach().to(resp.device).float()
        w = bilevel_weights(sal, reasoning, q=self.q, beta=self.beta, floor=self.floor, sum_to_L=self.sum_to_L)
        adv = seq_advantages[:, None].to(resp.device).float() * w * resp.float()
        # the metrics describe the rows whose weights act (A_i != 0): the same whether or not the saliency of the
        # other rows was computed (signals.skip_zero_rows)
        acting = (seq_advantages.to(resp.device) != 0)[:, None]
        n_r = (reasoning & acting).sum(-1)[acting[:, 0]]
        has = n_r > 0
        wr = w[reasoning & acting]
        metrics = {
            "reasoning_frac": float(n_r.sum() / (resp & acting).sum().clamp(min=1)),
            "no_reasoning_frac": float((~has).float().mean()) if has.numel() else 0.0,
        }
        if wr.numel():
            metrics.update({"weight_max": float(wr.max()), "weight_min": float(wr.min()),
                            "weight_std": float(wr.std(unbiased=False)),
                            "high_frac": float((wr >= 1.0).float().mean()),
                            "saliency_mean": float(sal[reasoning & acting].mean())})
        return CreditOutput(token_advantages=adv, metrics=metrics)


@register("oar_g")
class OARGAssigner(_OARBase):
    """OAR-G: reasoning-token weights from input-gradient saliency \
(docs/credit/oar.md#oar-g-input-gradient-saliency)."""

    needs = frozenset({Signal.INPUT_GRAD_SALIENCY, Signal.REASONING_MASK})
    saliency_signal = Signal.INPUT_GRAD_SALIENCY

    Options = OARGOptions

    def signal_options(self) -> dict[str, Any]:
        return {**super().signal_options(), "saliency_noise": self.saliency_noise}


@register("oar_p")
class OARPAssigner(_OARBase):
    """OAR-P: reasoning-token weights from counterfactual masking (docs/credit/oar.md#oar-p-counterfactual-masking)."""

    needs = frozenset({Signal.PERTURBATION_SALIENCY, Signal.REASONING_MASK})
    saliency_signal = Signal.PERTURBATION_SALIENCY

    Options = OARPOptions

    def signal_options(self) -> dict[str, Any]:
        return {**super().signal_options(), "perturb_stride": self.perturb_stride,
                "perturb_max_positions": self.perturb_max_positions, "perturb_kv_share": self.perturb_kv_share}
