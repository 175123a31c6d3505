"""MT-GRPO: outcome advantage plus group-normalised turn-reward advantages (docs/credit/mt_grpo.md).

Source: Zeng, Wei et al., arXiv 2505.11821; official code ``SiliangZeng/Multi-Turn-RL-Agent@7dbdd08b``
(``mt_grpo_env_trainer.py``). Tags: [SRC] read in the source, [INF] inferred, [PROPOSED] gearlab's choice.

Turn conventions (shared with ``assigners/gigpo.py``; defined here, checked by :func:`turn_layout`)
----------------------------------------------------------------------------------------------
* Turn k (0-based) = the policy's k-th generation **plus the environment / tool text that follows
  it**. ``batch.turn_ids[i, t]`` is that k for every real response token; the env tokens after
  generation k carry k as well. Text the environment shows before the first generation is prompt.
  Only the turn ids of generated tokens (``response_mask``) are read, plus, in ``k2_compat``, those
  of env tokens (``attention_mask & ~response_mask``). Padding turn ids are ignored.
* ``batch.turn_rewards[i, k]`` = the intermediate reward the environment gave for turn k, **not**
  including the outcome reward (that is ``batch.rewards``). A turn that happened but earned no
  intermediate reward holds 0. **NaN = the turn did not happen**: the finite entries of a row form a
  prefix (turns 0..n_i-1), NaN pads the rest up to K. ±inf, NaN before a finite entry, or a
  generated token whose turn id is outside 0..n_i-1 is a ValueError.

Advantages (token t of generated turn k of response i; A^O_i = ``seq_advantages`` = gearlab's group-
normalised outcome advantage, docs/grpo.md#group-advantages)
------------------------------------------------------------------------------------------------
``k2_compat=True`` — the released 2-turn rule, exactly [SRC]:
    R^T_i = turn_rewards[i, 0] (the tool turn's reward), A^T = group-norm(R^T),
    A^comb = group-norm(R^T + R^O) with R^O = batch.rewards.
    If response i has a tool result (env text after generation 0, or any later generation):
        A_{i,t} = A^O_i + λ·A^T_i on generation-0 tokens, A^O_i on every later generated token;
    else (no tool result) A_{i,t} = A^comb_i on every generated token (the GRPO-MR fallback).
    Later turns' rewards are ignored, as in the source (it splits at the first tool result only).

``k2_compat=False`` — K-turn generalisation [PROPOSED, non-canonical], A_{i,t} = A^O_i + λ·V_{i,k}:
  norm="per_turn"      V_{i,k} = Σ_{k'≥k} A^{T,k'}_i, A^{T,k'} = group-norm of r_{·,k'} over the members
                       of the group that HAD turn k' (missing turns dropped; 0 for i without turn k').
                       The natural per-turn-index port of the 2-turn code. BIASED when the policy
                       decides when to stop: the number of baseline terms subtracted depends on the
                       trajectory's own stopping turn, i.e. an action-dependent baseline that taxes
                       every extra turn by the group mean of its reward (verl#7244; \
docs/credit/mt_grpo.md#why-reward-to-go-is-the-default).
  norm="zero_fill"     V_{i,k} = Σ_{k'≥k} A^{T,k'}_i over ALL k' < K, A^{T,k'} = group-norm of r_{·,k'}
                       over the whole group with missing turns counted as reward 0. Every response
                       subtracts the same K-k baselines, so the baseline no longer depends on i's
                       stopping turn (unbiased), but it ignores whether a member ever reached turn k.
  norm="reward_to_go"  (default) V_{i,k} = group-norm of G_{·,k} = Σ_{k'≥k} r_{·,k'} (missing = 0) over
                       the members of the group that REACHED turn k. One baseline per turn: it depends
                       only on having reached turn k (the history before turn k's action), never on
                       how many turns i takes afterwards, so it is unbiased under policy-controlled
                       termination; conditioning on reaching k makes it a tighter baseline than
                       zero_fill, and one normalisation per turn keeps V O(1) however large K is.
  When only turn 0 carries a turn reward (later turns 0), all three modes give turn-0 tokens
  A^O + λ·A^T and later tokens A^O: the source rule without its no-tool-result fallback.

group-norm = ``gearlab.grpo.group_advantages(.., scale_by_std, eps)``: (R - mean_g)/(std_g + eps),
Bessel std; an all-equal group gives 0. For turn terms a group (or turn sub-group) with ONE member
gives 0 (no baseline to compare with) [PROPOSED]; A^comb, like A^O, keeps verl's raw-score rule.
Every non-generated token (env text, padding) gets 0.

Defaults: turn_coef λ = 1.0 [SRC ``turn_advantage_coef``]; eps = 1e-6 [PROPOSED: gearlab's
``algorithm.adv_eps``; the source uses 1e-4 — pass eps=1e-4 to match]; scale_by_std = True [SRC];
norm = "reward_to_go" [PROPOSED]; k2_compat = False.

Promises: preserves_sign / preserves_mass False (turn terms can flip the sign of A^O and change
the sum); keeps_zero_groups False (a response with A^O = 0 still gets turn credit).
Single-turn tasks: ``setup`` raises ValueError (never a silent fall-back to GRPO).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gearlab.core.batch import RolloutBatch
from gearlab.credit import CreditAssigner, CreditOutput, Signal, register
from gearlab.credit.options import option
from gearlab.core.grpo import group_advantages

NORMS = ("reward_to_go", "zero_fill", "per_turn")


# --------------------------------------------------------------------------- shared turn helpers
def require_multi_turn(task: Any, who: str) -> None:
    """The documented single-turn behaviour of turn-level assigners: an error at start-up."""
    if not getattr(task, "multi_turn", False):
        tname = getattr(task, "name", type(task).__name__)
        raise ValueError(f"{who} needs a multi-turn task with per-turn rewards; task {tname!r} is "
                         f"single-turn — use assigner=grpo, or a multi-turn task")


def turn_layout(batch: RolloutBatch, who: str) -> tuple[Tensor, Tensor, Tensor]:
    """Check the turn conventions (module docstring) and return

    n_turns [B] long: turns that happened per row (length of the finite prefix of turn_rewards)
    present [B, K] bool: turn k happened for row i (k < n_i)
    rewards [B, K] float: turn_rewards with NaN (turns that did not happen) replaced by 0
    """
    if batch.turn_ids is None or batch.turn_rewards is None:
        missing = [n for n in ("turn_ids", "turn_rewards") if getattr(batch, n) is None]
        raise ValueError(f"{who} needs per-turn data, but batch.{' and batch.'.join(missing)} is None; "
                         f"the rollout of a multi-turn task must fill turn_ids [B, T] and turn_rewards [B, K]")
    tr = batch.turn_rewards.float()
    if torch.isinf(tr).any():
        raise ValueError(f"{who}: batch.turn_rewards holds ±inf; use NaN only for turns that did not happen")
    present = ~torch.isnan(tr)
    gap = present[:, 1:] & ~present[:, :-1]
    if gap.any():
        i = int(gap.any(1).nonzero()[0])
        raise ValueError(f"{who}: batch.turn_rewards row {i} has NaN before a finite entry; NaN pads turns "
                         f"that did not happen (a suffix) — write 0 for a turn without an intermediate reward")
    n = present.sum(1)
    gen = batch.response_mask
    tid = batch.turn_ids.long()
    bad = gen & ((tid < 0) | (tid >= n[:, None]))
    if bad.any():
        i, t = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"{who}: generated token {t} of row {i} has turn id {int(tid[i, t])}, but the row has "
                         f"{int(n[i])} turn(s) by turn_rewards (finite entries); every generated turn needs a "
                         f"finite turn reward (0 if none)")
    return n, present, torch.where(present, tr, torch.zeros_like(tr))


def per_token(values: Tensor, batch: RolloutBatch) -> Tensor:
    """Broadcast per-turn values [B, K] onto the generated tokens of each turn -> [B, T], 0 elsewhere."""
    gen = batch.response_mask
    if values.shape[1] == 0:
        return torch.zeros(gen.shape, dtype=values.dtype, device=values.device)
    tid = torch.where(gen, batch.turn_ids.long(), torch.zeros_like(batch.turn_ids.long()))
    tid = tid.clamp(0, values.shape[1] - 1)
    out = values.gather(1, tid)
    return torch.where(gen, out, torch.zeros_like(out))


def reverse_cumsum(x: Tensor) -> Tensor:
    """out[:, k] = Σ_{k' ≥ k} x[:, k']."""
    return x.flip(1).cumsum(1).flip(1)


# --------------------------------------------------------------------------- the assigner
@dataclass
class MTGRPOOptions:
    turn_coef: float = option(1.0, "weight of the turn-reward advantage")
    norm: str = option("reward_to_go", "how turn rewards become advantages over K turns", choices=NORMS)
    k2_compat: bool = option(False, "the source's 2-turn rule (only valid for K = 2)")
    scale_by_std: bool = option(True, "divide turn advantages by the group std")
    eps: float = option(1e-6, "std floor", lo=0.0)


@register("mt_grpo")
class MTGRPOAssigner(CreditAssigner):
    needs = frozenset()
    requires_turns = True
    preserves_sign = False
    preserves_mass = False
    keeps_zero_groups = False

    Options = MTGRPOOptions

    def setup(self, *, seed: int, total_steps: int, task: Any) -> None:
        require_multi_turn(task, "mt_grpo")

    # group-norm of each column k of `values` over the rows where include[:, k]; 0 elsewhere
    def _norm_columns(self, values: Tensor, include: Tensor, group_ids: Tensor) -> Tensor:
        out = torch.zeros_like(values)
        for k in range(values.shape[1]):
            rows = include[:, k].nonzero().flatten()
            if rows.numel():
                out[rows, k] = group_advantages(values[rows, k], group_ids[rows], scale_by_std=self.scale_by_std,
                                                eps=self.eps, singleton="zero")
        return out

    def _turn_values(self, r: Tensor, present: Tensor, gids: Tensor) -> Tensor:
        if self.norm == "per_turn":
            return reverse_cumsum(self._norm_columns(r, present, gids))
        if self.norm == "zero_fill":
            return reverse_cumsum(self._norm_columns(r, torch.ones_like(present), gids))
        return self._norm_columns(reverse_cumsum(r), present, gids)  # reward_to_go

    def assign(self, batch: RolloutBatch, seq_advantages: Tensor, signals: dict[Signal, Tensor]) -> CreditOutput:
        n, present, r = turn_layout(batch, "mt_grpo")
        gen = batch.response_mask
        dev = gen.device
        B = batch.batch_size
        if tuple(seq_advantages.shape) != (B,):
            raise ValueError(f"mt_grpo: seq_advantages must be [B={B}], got {tuple(seq_advantages.shape)}")
        a_o = seq_advantages.detach().to(dev).float()
        gids = batch.group_ids.to(dev)
        r, present = r.to(dev), present.to(dev)
        metrics: dict[str, float] = {"turns_mean": float(n.float().mean()) if B else 0.0}
        if self.k2_compat:
            r_t = r[:, 0] if r.shape[1] else torch.zeros(B, device=dev)
            a_t = group_advantages(r_t, gids, scale_by_std=self.scale_by_std, eps=self.eps, singleton="zero")
            a_comb = group_advantages(r_t + batch.rewards.to(dev).float(), gids, scale_by_std=self.scale_by_std,
                                      eps=self.eps)
            tid = batch.turn_ids.to(dev).long()
            env = batch.attention_mask & ~gen
            has_result = (env & (tid == 0)).any(1) | (gen & (tid >= 1)).any(1)
            first = (tid == 0).float()
            with_tool = a_o[:, None] + self.turn_coef * a_t[:, None] * first
            adv = torch.where(has_result[:, None], with_tool, a_comb[:, None].expand_as(with_tool))
            turn_term = adv - a_o[:, None]
            metrics["no_tool_result_frac"] = float((~has_result).float().mean()) if B else 0.0
        else:
            values = self._turn_values(r, present, gids)
            turn_term = self.turn_coef * per_token(values, batch)
            adv = a_o[:, None] + turn_term
        adv = torch.where(gen, adv, torch.zeros_like(adv))
        m = gen.float()
        n_tok = m.sum().clamp_min(1)
        metrics["turn_term_abs_mean"] = float((turn_term.abs() * m).sum() / n_tok)
        flips = gen & (a_o[:, None] != 0) & (torch.sign(adv) != torch.sign(a_o)[:, None])
        metrics["sign_flip_frac"] = float(flips.float().sum() / n_tok)
        return CreditOutput(token_advantages=adv, metrics=metrics)
