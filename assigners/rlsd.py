"""RLSD: GRPO advantages reweighted per token by the privileged teacher's evidence, with a decaying mix.

Method: RLVR with Self-Distillation (Yang et al., arXiv 2604.03128; docs/credit/rlsd.md), as in the authors'
code (``_build_stgca_advantages`` and the λ schedule of the simple GRPO+RLSD trainer).

    Δ_{i,t} = sg( log π_T(y_t | x ⊕ answer, y_<t) − log π_S(y_t | x, y_<t) )          Eq. 13 [SRC]
    w_{i,t} = exp( sign(A_i) · Δ_{i,t} )                                                Eq. 14 [SRC]
    A_{i,t} = A_i · ( (1 − λ_s) + λ_s · clip(w_{i,t}, 1 − ε_w, 1 + ε_w) ) · m_{i,t}     Eq. 15 + code mix [SRC]

λ schedule [SRC code], with g = s + 1 the trainer's 1-based global step (s = iterations completed):
    g < warmup_steps          → λ · g / warmup_steps
    decay_steps > 0, g ≥ warm → λ · max(1 − (g − warmup_steps) / decay_steps, 0)
    otherwise                 → λ (constant)
Once λ_s = 0 the output is A_i · m_{i,t} exactly (plain GRPO; a short-circuit, no arithmetic).

Sign: the factor lies in [1 − λ ε_w, 1 + λ ε_w] ⊂ (0, 2) for λ ∈ [0, 1], ε_w ∈ [0, 1), so sign(A_{i,t}) =
sign(A_i) and A_i = 0 stays 0. Mass is not preserved (the factor is not mean-one).

Defaults and provenance:
  * λ = 0.5, ε_w = 0.2, warm-up 0, decay over 60 steps: [SRC] released script. (The paper, via an
    aggregator [3P], decays over 50.)
  * Teacher = frozen copy re-synced every K = 10 iterations: [PROPOSED] shared setting (= the paper [3P]; the
    released script uses 20 [SRC]). Teacher context = ground-truth answer [SRC].
  * negative_only (reweight only A_i < 0 sequences) [SRC option, off]; the thought-span-only option of
    the code is not implemented.
  * π_S = π_old (Signal.LOGPROBS) [INF]: the code detaches the log-probs of the update forward; the two
    coincide for on-policy μ = 1 updates (docs/credit/README.md#shared-settings-for-comparisons).
  * decay_steps = None → decay over setup(total_steps) [PROPOSED convenience].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gearlab.core.batch import RolloutBatch
from gearlab.credit import CreditAssigner, CreditOutput, Signal, register
from gearlab.credit.options import option


@dataclass
class RLSDOptions:
    lam: float = option(0.5, "peak weight λ of the teacher-evidence reweighting (from the end of the warm-up)",
                        lo=0.0, hi=1.0)
    clip_eps: float = option(0.2, "the reweighting factor is clipped to [1−ε, 1+ε]", lo=0.0, hi=1.0, hi_open=True)
    decay_steps: int | None = option(60, "λ decays linearly to 0 over this many iterations (None: the whole run)", lo=0)
    warmup_steps: int = option(0, "λ ramps up linearly over this many iterations (λ·g/warmup_steps at iteration g), "
                                  "then the decay starts; 0: no ramp", lo=0)
    teacher_sync_every: int = option(10, "the frozen teacher is re-synced every k iterations", lo=0)
    negative_only: bool = option(False, "reweight only negative-advantage sequences")


@register("rlsd")
class RLSDAssigner(CreditAssigner):
    needs = frozenset({Signal.TEACHER_LOGPROBS, Signal.LOGPROBS})
    preserves_sign = True
    preserves_mass = False
    teacher_mode = "frozen"
    teacher_context = "answer"

    Options = RLSDOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.steps_done = 0  # optimizer iterations completed (from on_step_end)
        self.total_steps: int | None = None

    # -- schedule ---------------------------------------------------------------------------------
    def setup(self, *, seed: int, total_steps: int, task: Any) -> None:
        self.total_steps = int(total_steps)

    def on_step_end(self, step: int) -> None:
        self.steps_done = int(step)

    def current_lambda(self) -> float:
        g = self.steps_done + 1
        decay = self.decay_steps if self.decay_steps is not None else (self.total_steps or 0)
        if self.warmup_steps > 0 and g < self.warmup_steps:
            return self.lam * g / self.warmup_steps
        if decay > 0:
            return self.lam * max(1.0 - (g - self.warmup_steps) / decay, 0.0)
        return self.lam

    def state_dict(self) -> dict[str, Any]:
        return {"steps_done": self.steps_done, "total_steps": self.total_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps_done = int(state.get("steps_done", 0))
        if state.get("total_steps") is not None:
            self.total_steps = int(state["total_steps"])

    # -- credit -----------------------------------------------------------------------------------
    def assign(self, batch: RolloutBatch, seq_advantages: Tensor, signals: dict[Signal, Tensor]) -> CreditOutput:
        mask = batch.response_mask  # [B, T] bool
        m = mask.float()
        a = seq_advantages.to(mask.device).float()[:, None]  # [B, 1]
        grpo = a * m  # [B, T]
        lam = self.current_lambda()
        metrics = {"rlsd/lambda": lam}
        if lam == 0.0:
            return CreditOutput(token_advantages=grpo, metrics=metrics)
        delta = (
            (signals[Signal.TEACHER_LOGPROBS].float() - signals[Signal.LOGPROBS].float()).to(mask.device) * m
        ).detach()
        w = torch.exp(torch.sign(a) * delta)  # [B, T]
        cw = w.clamp(1.0 - self.clip_eps, 1.0 + self.clip_eps)
        factor = (1.0 - lam) + lam * cw
        if self.negative_only:
            factor = torch.where(a < 0, factor, torch.ones_like(factor))
        adv = grpo * factor
        n = int(mask.sum())
        if n:
            metrics.update({
                "rlsd/delta_mean": float(delta[mask].mean()),
                "rlsd/weight_mean": float(w[mask].mean()),
                "rlsd/clip_low_frac": float((w[mask] < 1.0 - self.clip_eps).float().mean()),
                "rlsd/clip_high_frac": float((w[mask] > 1.0 + self.clip_eps).float().mean()),
            })
        return CreditOutput(token_advantages=adv, metrics=metrics)
