"""SDPO advantage blend — GRPO's outcome advantage mixed with self-distillation from a correct sibling
(Self-Distillation Policy Optimization, arXiv 2601.20802; docs/credit/sdpo.md).

    teacher context  the row's question followed by the first correct response of its group other than its own
                     (gearlab.rollout.base.SIBLING_TEMPLATE: TRL's SDPO templates, no feedback)     [SRC TRL]
    Δ_{i,t} = sg( log π_T(y_t | x ⊕ demo, y_<t) − log π_S(y_t | x, y_<t) ),   0 on rows without a demo
    A_{i,t} = ( λ · A_i + (1 − λ) · Δ_{i,t} ) · m_{i,t}

With ``algorithm.agg=seq-mean-token-mean`` this is exactly the gradient of TRL's ``SDPOTrainer`` loss
``(1 − w)·L_GRPO + w·L_SDPO`` with ``w = 1 − λ``, ``loss_type="grpo"`` and the sampled-token distillation loss, on
policy (tests/assigners/test_sdpo.py). The teacher is an EMA of the policy with update rate 0.05 (TRL's default
``teacher_model_kind="ema"``). The authors' own code has no blend (its SDPO mode replaces the policy loss).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gearlab.core.batch import RolloutBatch
from gearlab.credit import CreditAssigner, CreditOutput, Signal, register
from gearlab.credit.options import option
from gearlab.rollout.base import sibling_demonstrations


@dataclass
class SDPOOptions:
    lam: float = option(0.5, "weight of the GRPO advantage; 1 − lam goes to the distillation term [SRC TRL example: "
                             "distillation_weight 0.5]", lo=0.0, hi=1.0)
    teacher_mode: str = option("ema", "teacher weights: an EMA of the policy, the policy itself, or a frozen copy "
                                      "[SRC TRL teacher_model_kind]", choices=("ema", "live", "frozen"))
    teacher_ema: float = option(0.95, "teacher_mode=ema: decay (1 − TRL's teacher_update_rate 0.05)", lo=0.0, hi=1.0)
    teacher_sync_every: int = option(0, "teacher_mode=frozen: re-sync every k iterations (0 = never)", lo=0)


def has_sibling_demo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """[B] bool: rows whose teacher saw a solution (the engine's rule, rollout.base.sibling_demonstrations)."""
    demos = sibling_demonstrations(rewards, group_ids)
    return torch.tensor([d is not None for d in demos], device=rewards.device)


@register("sdpo")
class SDPOAssigner(CreditAssigner):
    """λ·GRPO + (1 − λ)·(log π_T − log π_S), the teacher prompted with a correct sibling (docs/credit/sdpo.md)."""

    needs = frozenset({Signal.TEACHER_LOGPROBS, Signal.LOGPROBS})
    keeps_zero_groups = False  # an all-correct group still distils from its siblings
    teacher_context = "sibling"

    Options = SDPOOptions

    def setup(self, *, seed: int, total_steps: int, task: Any) -> None:
        if getattr(task, "multi_turn", False):
            raise ValueError("sdpo: the sibling-solution teacher is single-turn only (a multi-turn task was given)")

    def chunk_local(self, rows: int) -> bool:
        return False  # a row's demo depends on the other rows of its group

    def assign(self, batch: RolloutBatch, seq_advantages: Tensor, signals: dict[Signal, Tensor]) -> CreditOutput:
        mask = batch.response_mask
        m = mask.float()
        demo = has_sibling_demo(batch.rewards.to(mask.device), batch.group_ids.to(mask.device))
        delta = (signals[Signal.TEACHER_LOGPROBS].float() - signals[Signal.LOGPROBS].float()).to(mask.device)
        delta = (delta * m * demo[:, None].float()).detach()
        adv = (self.lam * seq_advantages.to(mask.device).float()[:, None] * m + (1.0 - self.lam) * delta) * m
        on = mask & demo[:, None]
        metrics = {"sdpo/demo_frac": float(demo.float().mean()) if demo.numel() else 0.0}
        if on.any():
            metrics.update({"sdpo/delta_mean": float(delta[on].mean()),
                            "sdpo/delta_abs_mean": float(delta[on].abs().mean())})
        return CreditOutput(token_advantages=adv, metrics=metrics)
