"""OPSD, sampled-token form: the token advantage is the teacher-minus-student log-prob gap.

Method: On-Policy Self-Distillation (Zhao et al., arXiv 2601.18734; docs/credit/opsd.md), the
``--use_tinker_loss`` path of the authors' code (the full-vocabulary JSD path is not a per-token
advantage and is not implemented here).

    Δ_{i,t} = sg( log π_T(y_t | x ⊕ c, y_<t) − log π_S(y_t | x, y_<t) )            [SRC]
    A_{i,t} = ( coef · clip(Δ_{i,t}, ±clip) + outcome_coef · A_i ) · m_{i,t}

With the defaults (coef 1, clip off, outcome_coef 0) this is exactly the source objective
L = −mean_t Δ_t log π_S(y_t): the core's token-mean clipped surrogate has that gradient at ratio 1.

Provenance of each part:
  * Δ on generated tokens, detached, same temperature for both: [SRC].
  * No outcome reward (outcome_coef = 0): [SRC] OPSD is self-distillation only \
(docs/credit/rlsd.md#relation-to-opsd-and-grpo
    relation (docs/credit/rlsd.md#relation-to-opsd-and-grpo): OPSD with reverse KL ≙ Â_t = Δ_t). outcome_coef > 0 \
gives a GRPO+OPSD sum
    [PROPOSED option, not a source method].
  * coef = 1: [SRC] (no scale in the source loss).
  * clip = None: [SRC] the source has no clipping on this path ("can be unstable"); a positive value
    clamps Δ to [−clip, clip] [PROPOSED option].
  * π_S = π_old (Signal.LOGPROBS) [INF]: the source uses the current student forward, detached; the
    two coincide for on-policy μ = 1 updates (docs/credit/README.md#shared-settings-for-comparisons).
  * Teacher context "solution" (full reference solution; the task falls back to the answer when it
    has none): [SRC] and docs/credit/README.md#shared-settings-for-comparisons.
  * Teacher weights "live" (the current policy): [PROPOSED] shared setting \
(docs/credit/README.md#shared-settings-for-comparisons). The source's main runs
    use a FIXED teacher (θ₀): set teacher_mode="frozen", teacher_sync_every=0 to reproduce it [SRC].
"""
from __future__ import annotations

from dataclasses import dataclass
from torch import Tensor

from gearlab.core.batch import RolloutBatch
from gearlab.credit import CreditAssigner, CreditOutput, Signal, register
from gearlab.credit.options import option


@dataclass
class OPSDOptions:
    coef: float = option(1.0, "scale of the distillation advantage log π_T − log π_S")
    outcome_coef: float = option(0.0, "weight of the GRPO outcome advantage added to it (0 = pure distillation)")
    clip: float | None = option(None, "clip |A_t| at this value (None = no clip)", lo=0.0, lo_open=True)
    teacher_mode: str = option("live", "teacher weights: the current policy, a frozen copy, or an EMA",
                               choices=("live", "frozen", "ema"))
    teacher_sync_every: int = option(0, "teacher_mode=frozen: re-sync every k iterations (0 = never)", lo=0)
    teacher_context: str = option("solution", "privileged context the teacher sees", choices=("answer", "solution"))


@register("opsd")
class OPSDAssigner(CreditAssigner):
    needs = frozenset({Signal.TEACHER_LOGPROBS, Signal.LOGPROBS})
    preserves_sign = False  # Δ has its own sign, unrelated to the reward
    preserves_mass = False
    keeps_zero_groups = False  # pure distillation: Δ ≠ 0 even where A_i = 0

    Options = OPSDOptions

    def assign(self, batch: RolloutBatch, seq_advantages: Tensor, signals: dict[Signal, Tensor]) -> CreditOutput:
        mask = batch.response_mask  # [B, T] bool
        m = mask.float()
        delta = (signals[Signal.TEACHER_LOGPROBS].float() - signals[Signal.LOGPROBS].float()).to(mask.device) * m
        delta = delta.detach()
        d = delta if self.clip is None else delta.clamp(-self.clip, self.clip)
        adv = self.coef * d
        if self.outcome_coef != 0.0:
            adv = adv + self.outcome_coef * seq_advantages.to(mask.device).float()[:, None]
        adv = adv * m
        n = int(mask.sum())
        metrics = {
            "opsd/delta_mean": float(delta[mask].mean()) if n else 0.0,
            "opsd/delta_abs_mean": float(delta[mask].abs().mean()) if n else 0.0,
            "opsd/frac_delta_positive": float((delta[mask] > 0).float().mean()) if n else 0.0,
        }
        if self.clip is not None:
            metrics["opsd/frac_clipped"] = float((delta[mask].abs() > self.clip).float().mean()) if n else 0.0
        return CreditOutput(token_advantages=adv, metrics=metrics)
