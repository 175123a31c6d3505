"""Forking-token credit: the policy gradient flows only through the highest-entropy tokens.

Method: "Beyond the 80/20 Rule" (Wang et al., arXiv 2506.01939), docs/credit/entropy_fork.md.

    M_{i,t} = 1  iff  H_{i,t} is among the top-k entropies of the valid tokens in the scope,
    k = max(1, int(N_valid · ρ + 0.9999))   (ceil as written in the paper code)      [SRC]
        (the max(1, ·) guard: [3P] a re-implementation citing the paper code; it only matters for N·ρ < 1e-4)
    A_{i,t} = A_i · m_{i,t}                 (advantages unchanged, GRPO broadcast)    [SRC]

Normaliser (option ``normaliser``):
  "paper" (default) [SRC paper code]: ``CreditOutput.loss_mask = M``; the token-mean divides by
          the number of SELECTED tokens (``agg_loss(pg, response_mask * entropy_top_mask)``).
  "trl"   [SRC TRL ``top_entropy_quantile``]: no loss mask; A_{i,t} = 0 where M = 0, so those tokens
          add a zero clipped-surrogate term but still count in the normaliser (all active tokens).
          TRL keeps ties at a quantile threshold; here both modes select exactly k tokens with topk.

Scope (option ``scope``):
  "batch" (default) [PROPOSED]: one top-k over every valid token of the rollout batch. The paper code
          selects inside each update micro-batch, which makes the selected set, and so the results,
          depend on ``ppo_micro_batch_size`` (and on the data-parallel split); a batch-wide top-k is
          invariant to those engineering knobs.
  "micro_batch" [SRC behaviour]: top-k within consecutive row chunks of ``micro_batch_size`` rows.
          It matches the core's update micro-batches only when mini_batches == 1 (rows in order).

Entropy [INF]: H_t of π_old (Signal.ENTROPY). The paper code uses the update forward of the current
policy; with μ = 1 on-policy updates (docs/credit/README.md#shared-settings-for-comparisons) both are the same policy.
Selection uses ``torch.topk``, never ``torch.quantile`` (which fails above 2^24 elements).
With "paper", the loss mask restricts only the policy-gradient term: the core applies a KL penalty and an entropy
bonus over every generated token (the full response mask), as the paper code does; the shared comparison setting
uses neither.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any
import torch
from torch import Tensor

from gearlab.core.batch import RolloutBatch
from gearlab.credit import CreditAssigner, CreditOutput, Signal, register
from gearlab.credit.options import OptionError, option


def top_fraction_mask(values: Tensor, valid: Tensor, rho: float) -> Tensor:
    """[B, T] bool: exactly k = max(1, int(N·ρ + 0.9999)) of the N valid positions with the largest
    ``values`` (ties broken by ``torch.topk``); all False when no position is valid."""
    out = torch.zeros_like(valid, dtype=torch.bool)
    n = int(valid.sum())
    if n == 0:
        return out
    k = min(n, max(1, int(n * rho + 0.9999)))
    pos = valid.flatten().nonzero(as_tuple=False).squeeze(1)  # flat indices of the valid tokens
    idx = torch.topk(values.flatten()[pos], k, sorted=False).indices
    out.view(-1)[pos[idx]] = True
    return out


@dataclass
class EntropyForkOptions:
    rho: float = option(0.2, "share of the highest-entropy tokens that get a gradient", lo=0.0, lo_open=True, hi=1.0)
    normaliser: str = option("paper", "loss normaliser: the 80/20 paper code's, or TRL's", choices=("paper", "trl"))
    scope: str = option("batch", "where the top-ρ is taken: the whole batch, or each micro-batch",
                        choices=("batch", "micro_batch"))
    micro_batch_size: int | None = option(None, "scope=micro_batch: sequences per micro-batch", lo=1)


@register("entropy_fork")
class EntropyForkAssigner(CreditAssigner):
    needs = frozenset({Signal.ENTROPY})
    preserves_sign = True  # A_{i,t} is A_i or 0
    preserves_mass = False  # "trl" zeroes unselected tokens; "paper" drops them from the loss

    Options = EntropyForkOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        if self.scope == "micro_batch" and self.micro_batch_size is None:
            raise OptionError(
                "assigner.options.micro_batch_size", "scope='micro_batch' needs a positive micro_batch_size"
            )

    def chunk_local(self, rows: int) -> bool:
        # micro-batch scope selects within chunks of micro_batch_size rows; the paper normaliser's loss mask would
        # have to be counted before the update's forwards, so only the "trl" normaliser qualifies
        return self.scope == "micro_batch" and self.normaliser == "trl" and rows % (self.micro_batch_size or 1) == 0

    def select(self, entropy: Tensor, mask: Tensor) -> Tensor:
        """[B, T] bool selection M (subset of ``mask``) under the configured scope."""
        if self.scope == "batch":
            return top_fraction_mask(entropy, mask, self.rho)
        sel = torch.zeros_like(mask, dtype=torch.bool)
        step = self.micro_batch_size
        assert step is not None
        for s in range(0, mask.shape[0], step):
            sel[s : s + step] = top_fraction_mask(entropy[s : s + step], mask[s : s + step], self.rho)
        return sel

    def assign(self, batch: RolloutBatch, seq_advantages: Tensor, signals: dict[Signal, Tensor]) -> CreditOutput:
        mask = batch.response_mask
        ent = signals[Signal.ENTROPY].to(mask.device).float().detach()
        sel = self.select(ent, mask)
        adv = seq_advantages[:, None].to(mask.device).float() * mask.float()  # [B, T] GRPO broadcast
        n_valid, n_sel = int(mask.sum()), int(sel.sum())
        metrics = {
            "entropy_fork/frac_selected": n_sel / n_valid if n_valid else 0.0,
            "entropy_fork/entropy_selected_mean": float(ent[sel].mean()) if n_sel else 0.0,
            "entropy_fork/entropy_all_mean": float(ent[mask].mean()) if n_valid else 0.0,
        }
        if self.normaliser == "paper":
            return CreditOutput(token_advantages=adv, loss_mask=sel, metrics=metrics)
        return CreditOutput(
            token_advantages=torch.where(sel, adv, torch.zeros_like(adv)), loss_mask=None, metrics=metrics
        )
