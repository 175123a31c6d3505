"""GRAIL — gradient × activation saliency of the answer reweights GRPO's token advantages (arXiv 2606.04889;
docs/credit/grail.md). Written from the authors' code, declare-lab/grail@749aa4c (``compute_grail_weights``).

    s_t = ‖∂J/∂a ⊙ a‖₂ at the position predicting y_t, J = −Σ_{answer span} log π     (signal answer_nll_saliency)
    z_t = (log(s_t + 1e-8) − μ_i) / sqrt(σ_i² + 1e-8)      μ_i, σ_i: mean and population std over row i's tokens
    w_t = clip(mean + std · z_t, w_min, w_max)            rows left out (no answer, or ``symmetry``): w = 1
    overrides on rows with an answer: value tokens → w_max; the marker → mean; tokens after the answer → mean
    A_{i,t} = A_i · w_t · m_t

No renormalisation (the source has none): the mass Σ_t A_{i,t} is not N_i · A_i. The defaults are the released
``qwen3_grail.yaml`` (std 0.5, mean 1, w_min 0.5, w_max 5, embeddings, symmetry ``wrong``); the config class's
own defaults differ (w_min 0.1, symmetry ``both``, and no std at all, which makes the source raise).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gearlab.core.batch import RolloutBatch
from gearlab.credit import CreditAssigner, CreditOutput, register
from gearlab.credit.options import option

ANSWER_NLL_SALIENCY = "answer_nll_saliency"  # gearlab.signals.answer_saliency
ANSWER_SPAN_MASK = "answer_span_mask"  # gearlab.signals.spans
ANSWER_VALUE_MASK = "answer_value_mask"  # gearlab.signals.spans
SYMMETRIES = ("both", "correct", "wrong")


@dataclass
class GRAILOptions:
    std: float = option(0.5, "spread of the weights around `mean` per unit z-score [SRC qwen3_grail.yaml]",
                        lo=0.0, lo_open=True)
    mean: float = option(1.0, "weight of a token of average log-saliency; also the marker's and the tail's [SRC]",
                         lo=0.0)
    w_min: float = option(0.5, "smallest weight [SRC qwen3_grail.yaml; the config class says 0.1]", lo=0.0)
    w_max: float = option(5.0, "largest weight, and the answer value's [SRC]", lo=0.0, lo_open=True)
    leaf: str = option("embeddings", "where the gradient is taken: the input embeddings or a layer's hidden states",
                       choices=("embeddings", "first", "middle", "last"))
    symmetry: str = option("wrong", "which rollouts are reweighted, by the sign of A_i: both, correct (A > 0) or "
                                    "wrong (A <= 0) [SRC qwen3_grail.yaml]", choices=SYMMETRIES)
    answer_overrides: bool = option(True, "value tokens get w_max, the marker and the tail `mean` on every row with "
                                          "an answer [SRC; false = saliency weights there too, PROPOSED]")


def answer_regions(span: Tensor, value: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(has_answer [B, 1], marker [B, T], value [B, T], tail [B, T]) bool from the final-answer span and its value
    ([B, T] masks) and the response mask: the marker is the span without the value, the tail every response token
    after the span (the stop token). A row without a span has no answer."""
    m = mask.bool()
    span, value = span.bool() & m, value.bool() & span.bool() & m
    pos = torch.arange(m.shape[1], device=m.device)[None]
    last = torch.where(span, pos, -1).amax(-1, keepdim=True)
    has = span.any(-1, keepdim=True)
    return has, span & ~value, value, m & (pos > last) & has


def grail_weights(saliency: Tensor, mask: Tensor, seq_adv: Tensor, has_answer: Tensor, marker: Tensor,
                  value: Tensor, tail: Tensor, *, std: float = 0.5, mean: float = 1.0, w_min: float = 0.5,
                  w_max: float = 5.0, symmetry: str = "wrong", answer_overrides: bool = True) -> Tensor:
    """GRAIL token weights [B, T] float32 (module docstring) from the saliency [B, T], the response mask [B, T], the
    sequence advantages [B], and the answer regions of :func:`answer_regions`."""
    m = mask.float()
    left_out = ~has_answer.bool()
    a = seq_adv.float()[:, None]
    if symmetry == "correct":
        left_out = left_out | (a <= 0)
    elif symmetry == "wrong":
        left_out = left_out | (a > 0)
    logs = torch.log(saliency.float() + 1e-8)
    n = m.sum(-1, keepdim=True).clamp(min=1.0)
    mu = (logs * m).sum(-1, keepdim=True) / n
    sd = torch.sqrt((((logs - mu) ** 2) * m).sum(-1, keepdim=True) / n + 1e-8)
    w = (mean + std * (logs - mu) / sd).clamp(w_min, w_max)
    w = torch.where(left_out, torch.ones_like(w), w) * m
    if answer_overrides:
        w = torch.where(value.bool(), torch.full_like(w, w_max), w)
        w = torch.where((marker.bool() | tail.bool()) & m.bool(), torch.full_like(w, mean), w)
    return w


@register("grail")
class GRAILAssigner(CreditAssigner):
    """GRAIL: token weights from the answer's gradient × activation saliency (docs/credit/grail.md)."""

    needs = frozenset({ANSWER_NLL_SALIENCY, ANSWER_SPAN_MASK, ANSWER_VALUE_MASK})
    preserves_sign = True  # w ≥ 0
    preserves_mass = False  # no renormalisation, as in the source

    Options = GRAILOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        if not self.answer_overrides:  # the value tokens are then weighted like any other
            self.needs = frozenset({ANSWER_NLL_SALIENCY, ANSWER_SPAN_MASK})

    def signal_options(self) -> dict[str, Any]:
        return {"leaf": self.leaf}

    def assign(self, batch: RolloutBatch, seq_advantages: Tensor, signals: dict[Any, Tensor]) -> CreditOutput:
        resp = batch.response_mask.bool()
        dev = resp.device
        span = signals[ANSWER_SPAN_MASK].detach().to(dev).bool()
        value = signals[ANSWER_VALUE_MASK].detach().to(dev).bool() if ANSWER_VALUE_MASK in signals else span
        sal = signals[ANSWER_NLL_SALIENCY].detach().to(dev).float()
        has, marker, value, tail = answer_regions(span, value, resp)
        w = grail_weights(sal, resp, seq_advantages.to(dev), has, marker, value, tail, std=self.std, mean=self.mean,
                          w_min=self.w_min, w_max=self.w_max, symmetry=self.symmetry,
                          answer_overrides=self.answer_overrides)
        adv = seq_advantages[:, None].to(dev).float() * w * resp.float()
        wr = w[resp]
        metrics = {"no_answer_frac": float((~has).float().mean())}
        if wr.numel():
            metrics.update({"weight_mean": float(wr.mean()), "weight_std": float(wr.std(unbiased=False)),
                            "weight_max": float(wr.max()), "weight_min": float(wr.min())})
        return CreditOutput(token_advantages=adv, metrics=metrics)
