"""OTB: the optimal token baseline — a per-position baseline from each response's accumulated "realized energy".

Method: Li et al., arXiv 2602.07078; code ``verl-project/verl@018f23b5``: ``compute_optimal_token_baseline_advantage``
in ``verl/trainer/ppo/core_algos.py`` (the single-turn estimator ``optimal_token_baseline``)
and verl's OTB documentation page
(Σπ² from the logits). docs/credit/otb.md.

For response i of a group with outcome reward R_i (at its last token, so its reward-to-go is G_{i,t} = R_i on every
generated position), π_{i,t} the policy's probability of the sampled token and Σπ²_{i,t} its collision probability
(signals ``logprobs`` and ``sum_pi_squared``, both at the sampling temperature):

    w_{i,t} = 1 − 2 π_{i,t} + Σπ²_{i,t}          (= ‖e_y − π‖²: the logit-gradient proxy)                [SRC]
    W_{i,t} = Σ_{j ≤ t} w_{i,j} m_{i,j}                                                                    [SRC]
    B_t     = Σ_i G_{i,t} W_{i,t} m_{i,t} / (Σ_i W_{i,t} m_{i,t} + ε)   over the group, position by position  [SRC]
    A_{i,t} = (G_{i,t} − B_t) m_{i,t}                                                                      [SRC]

A one-response group has B = 0 (A = R). With ``handle_zero_tail``, positions of a group's single longest response
past the second-longest get B = 0 [SRC]. The advantage is not divided by a standard deviation, and gearlab's
group-normalised sequence advantage is not used [SRC]. Positions are aligned by index from the first generated token
(the single-turn estimator); verl's multi-turn variant, which aligns generated tokens across turns, is not
reconstructed, and its rollout importance weights (W scaled by ρ̄²) are not supported.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gearlab.core.batch import RolloutBatch
from gearlab.credit import CreditAssigner, CreditOutput, Signal, register
from gearlab.credit.options import option

SUM_PI_SQUARED = "sum_pi_squared"  # gearlab.signals.collision


@dataclass
class OTBOptions:
    handle_zero_tail: bool = option(True, "a group's single longest response gets baseline 0 past the second-longest "
                                          "[SRC: default True at 018f23b5]")
    epsilon: float = option(1e-8, "added to the denominator Σ_i W_{i,t} [SRC]", lo=0.0)


def otb_advantages(rewards: Tensor, mask: Tensor, logprobs: Tensor, sum_pi_sq: Tensor, groups: Tensor,
                   handle_zero_tail: bool = True, epsilon: float = 1e-8) -> Tensor:
    """OTB token advantages [B, T] float32 from outcome rewards [B], the response mask [B, T], the sampled tokens'
    log-probs [B, T], the collision probabilities [B, T] and group ids [B]."""
    m = mask.float()
    G = rewards.float()[:, None] * m  # the reward-to-go of a reward on the last generated token
    w = 1 - 2 * logprobs.float().exp() + sum_pi_sq.float()
    Wm = (w * m).cumsum(-1) * m  # W_{i,t} on generated positions, 0 after the response
    base = torch.zeros_like(G)
    for g in torch.unique(groups).tolist():
        rows = (groups == g).nonzero().flatten()
        if len(rows) < 2:
            continue
        b = (G[rows] * Wm[rows]).sum(0) / (Wm[rows].sum(0) + epsilon)
        base[rows] = b[None].expand(len(rows), -1)
        if handle_zero_tail:
            lengths = m[rows].sum(-1)
            top2 = torch.sort(lengths).values[-2:]
            longest = (lengths == top2[1]).nonzero().flatten()
            if len(longest) == 1 and top2[1] > top2[0]:
                base[rows[longest[0]], int(top2[0]):] = 0.0
    return (G - base) * m


@register("otb")
class OTBAssigner(CreditAssigner):
    needs = frozenset({Signal.LOGPROBS, SUM_PI_SQUARED})
    preserves_sign = False  # B_t is a weighted mean of the group's rewards: a response can sit on either side
    preserves_mass = False
    keeps_zero_groups = False  # an all-equal group keeps a residue R·ε/(ΣW + ε), and R where every W is 0

    Options = OTBOptions

    def chunk_local(self, rows: int) -> bool:
        return False  # the baseline of a position uses every response of the group

    def assign(self, batch: RolloutBatch, seq_advantages: Tensor, signals: dict[Signal, Tensor]) -> CreditOutput:
        mask = batch.response_mask.bool()
        adv = otb_advantages(batch.rewards.detach(), mask, signals[Signal.LOGPROBS].detach(),
                             signals[SUM_PI_SQUARED].detach(), batch.group_ids, self.handle_zero_tail, self.epsilon)
        n = int(mask.sum())
        metrics = {"otb/adv_abs_mean": float(adv[mask].abs().mean()) if n else 0.0}
        return CreditOutput(token_advantages=adv, metrics=metrics)
