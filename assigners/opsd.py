"""OPSD, sampled-token form: the token advantage is the teacher-minus-student log-prob gap.

Method: On-Policy Self-Distillation (Zhao et al., arXiv 2601.18734), methods.md §6.1, the
``--use_tinker_loss`` path of the authors' code (the full-vocabulary JSD path is not a per-token
advantage and is not implemented here).

    Δ_{i,t} = sg( log π_T(y_t | x ⊕ c, y_<t) − log π_S(y_t | x, y_<t) )            [SRC]
    A_{i,t} = ( coef · clip(Δ_{i,t}, ±clip) + outcome_coef · A_i ) · m_{i,t}

With the defaults (coef 1, clip off, outcome_coef 0) this is exactly the source objective
L = −mean_t Δ_t log π_S(y_t): the core's token-mean clipped surrogate has that gradient at ratio 1.

Provenance of each part:
  * Δ on generated tokens, detached, same temperature for both: [SRC].
  * No outcome reward (outcome_coef = 0): [SRC] OPSD is self-distillation only (methods.md §6.2
    §4.3 relation: OPSD with reverse KL ≙ Â_t = Δ_t). outcome_coef > 0 gives a GRPO+OPSD sum
    [PROPOSED option, not a source method].
  * coef = 1: [SRC] (no scale in the source loss).
  * clip = None: [SRC] the source has no clipping on this path ("can be unstable"); a positive value
    clamps Δ to [−clip, clip] [PROPOSED option].
  * π_S = π_old (Signal.LOGPROBS) [INF]: the source uses the current student forward, detached; the
    two coincide for on-policy μ = 1 updates (methods.md §9b).
  * Teacher context "solution" (full reference solution; the task falls back to the answer when it
    has none): [SRC] and §9b.
  * Teacher weights "live" (the current policy): [PROPOSED] §9b shared setting. The source's main runs
    use a FIXED teacher (θ₀): set teacher_mode="frozen", teacher_sync_every=0 to reproduce it [SRC].
"""
from __future__ import annotations

from torch import Tensor

from gearlab.batch import RolloutBatch
from gearlab.credit import CreditAssigner, CreditOutput, Signal, register


@register("opsd")
class OPSDAssigner(CreditAssigner):
    needs = frozenset({Signal.TEACHER_LOGPROBS, Signal.LOGPROBS})
    preserves_sign = False  # Δ has its own sign, unrelated to the reward
    preserves_mass = False
    keeps_zero_groups = False  # pure distillation: Δ ≠ 0 even where A_i = 0

    def __init__(self, coef: float = 1.0, outcome_coef: float = 0.0, clip: float | None = None,
                 teacher_mode: str = "live", teacher_sync_every: int = 0, teacher_context: str = "solution") -> None:
        if clip is not None and not clip > 0:
            raise ValueError(f"opsd: clip must be None or > 0, got {clip}")
        if teacher_mode not in ("live", "frozen", "ema"):
            raise ValueError(f"opsd: teacher_mode must be live, frozen or ema, got {teacher_mode!r}")
        if teacher_context not in ("answer", "solution"):
            raise ValueError(f"opsd: teacher_context must be 'answer' or 'solution', got {teacher_context!r}")
        if int(teacher_sync_every) < 0:
            raise ValueError(f"opsd: teacher_sync_every must be >= 0, got {teacher_sync_every}")
        self.coef = float(coef)
        self.outcome_coef = float(outcome_coef)
        self.clip = None if clip is None else float(clip)
        self.teacher_mode = teacher_mode
        self.teacher_sync_every = int(teacher_sync_every)
        self.teacher_context = teacher_context

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
