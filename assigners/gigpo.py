"""GiGPO: episode-group advantage plus anchor-state step-group advantage (docs/credit/gigpo.md).

Source: Feng et al., arXiv 2505.10978 (NeurIPS 2025); code ``gigpo/core_gigpo.py`` of the fork
``vanzll/verl-agent@d0b97244`` (equation numbers from its comments). Tags: [SRC] read in the source,
[INF] inferred, [PROPOSED] gearlab's choice.

Layout. verl-agent stores one row per (trajectory, step). gearlab stores one row per trajectory and
marks turns with ``turn_ids``; a "step" here is a turn (i, k). Turn / padding conventions are those of
``assigners/mt_grpo.py`` (turn k = generation k + the env text after it; ``turn_rewards`` holds the
intermediate rewards, NaN pads turns that did not happen, outcome excluded). In addition
``batch.meta["anchor_obs"]`` is a list of B lists; ``anchor_obs[i][k]`` is the observation the policy
saw before turn k of row i (hashable: str, number, tuple…; lists/dicts/tensors are converted), and
``len(anchor_obs[i])`` must equal the row's number of turns n_i.

Formulas (group g = rows with the same ``group_ids``; F_norm = 1 for mode "mean_norm", the std for
"mean_std_norm"; group-norm = ``gearlab.grpo.group_advantages``, Bessel std, + eps):
  step rewards   r̃_{i,k} = turn_rewards[i,k], plus batch.rewards[i] on the last turn when
                 ``outcome_in_returns`` [INF: verl-agent's terminal success reward is the reward of
                 the last step, so it discounts back to every earlier step; without it a sparse,
                 outcome-only task would have R_t ≡ 0 and A^S ≡ 0].
  episode return R(τ_i) = Σ_k r̃_{i,k} = outcome + Σ_k turn rewards (outcome only when
                 ``outcome_in_returns=False``). ``seq_advantages`` is NOT used: A^E has its own
                 F_norm mode, which need not match ``algorithm.scale_by_std``.
  Eq. 3  A^E_i = (R(τ_i) - mean_g R) / F_norm. ``cross_steps=True`` [SRC default of
                 ``compute_mean_std_cross_steps``]: mean and std run over the STEP items of the group,
                 i.e. trajectory i counted n_i times (longer trajectories weigh more); False: over
                 trajectories, once each. Singleton (a group with one item): A^E = R (verl's mean 0 /
                 std 1). All-equal group: 0.
  Eq. 5  R_{i,t} = Σ_{k=t}^{n_i-1} γ^{k-t} r̃_{i,k}.
  Eq. 6  Step groups: within an episode group, turns (of any row, also two turns of one row) whose
                 anchor observations are identical share a step group. Optional similarity grouping
                 (``similarity_thresh`` in (0, 1), text observations only): each observation joins the
                 first existing cluster whose representative (its first member) has
                 ``difflib.SequenceMatcher(None, a, b).ratio() >= similarity_thresh``, else starts one.
  Eq. 7  A^S_{i,k} = (R_{i,k} - mean_{step group} R) / F_norm; a singleton step group gives 0.
  Eq. 8  A_{i,t∈turn k} = A^E_i + ω·A^S_{i,k} on the generated tokens of turn k; 0 on env / pad tokens.
  When no observation repeats inside a group, every step group is a singleton, A^S ≡ 0 and GiGPO is
  the episode advantage alone.

Defaults: mode "mean_norm" [SRC config default; the ALFWorld script uses "mean_std_norm"], γ = 0.95
[SRC ALFWorld script], step_coef ω = 1.0 [SRC ``step_advantage_w``], eps = 1e-6 [SRC], cross_steps
True [SRC], similarity_thresh None = exact grouping [SRC default; the search script uses 0.9],
outcome_in_returns True [INF, above].

Promises: preserves_sign / preserves_mass False; keeps_zero_groups False (A^E is recomputed and
A^S can be non-zero where A^O = 0). Single-turn tasks: ``setup`` raises ValueError.
"""
from __future__ import annotations

from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Any, Hashable

import torch
from torch import Tensor

from .mt_grpo import per_token, require_multi_turn, turn_layout
from gearlab.core.batch import RolloutBatch
from gearlab.credit import CreditAssigner, CreditOutput, Signal, register
from gearlab.credit.options import option
from gearlab.core.grpo import group_advantages

MODES = ("mean_norm", "mean_std_norm")


def _hashable(x: Any) -> Hashable:
    """A hashable key for an observation (lists/tuples, dicts and tensors are converted)."""
    if isinstance(x, Tensor):
        return ("tensor", tuple(x.shape), tuple(x.flatten().tolist()))
    if isinstance(x, (list, tuple)):
        return tuple(_hashable(e) for e in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in x.items()))
    try:
        hash(x)
    except TypeError:
        raise ValueError(f"gigpo: anchor observation of type {type(x).__name__} is not hashable") from None
    return x


@dataclass
class GiGPOOptions:
    mode: str = option("mean_norm", "step-group normalisation", choices=MODES)
    gamma: float = option(0.95, "discount of the step returns", lo=0.0, hi=1.0)
    step_coef: float = option(1.0, "weight of the anchor-state step advantage A^S")
    eps: float = option(1e-6, "std floor", lo=0.0)
    cross_steps: bool = option(True, "an anchor state groups steps across turns")
    similarity_thresh: float | None = option(None,
                                             "group text observations whose similarity exceeds this (None: exact)",
                                             lo=0.0, lo_open=True, hi=1.0, hi_open=True)
    outcome_in_returns: bool = option(True, "the outcome reward is part of the step returns")


@register("gigpo")
class GiGPOAssigner(CreditAssigner):
    needs = frozenset()
    requires_turns = True
    preserves_sign = False
    preserves_mass = False
    keeps_zero_groups = False

    Options = GiGPOOptions

    def setup(self, *, seed: int, total_steps: int, task: Any) -> None:
        require_multi_turn(task, "gigpo")

    # Eq. 6: one dense step-group id per item (i, k), items listed row by row
    def _step_groups(self, items: list[tuple[int, int]], obs: list[list[Any]], gids: list[int]) -> list[int]:
        out: list[int] = []
        if self.similarity_thresh is None:
            ids: dict[tuple[int, Hashable], int] = {}
            for i, k in items:
                out.append(ids.setdefault((gids[i], _hashable(obs[i][k])), len(ids)))
            return out
        clusters: dict[int, list[tuple[str, int]]] = {}  # episode group -> [(representative, id)]
        n_ids = 0
        for i, k in items:
            o = obs[i][k]
            if not isinstance(o, str):
                raise ValueError(f"gigpo: similarity grouping needs text observations; anchor_obs[{i}][{k}] is "
                                 f"{type(o).__name__} (set similarity_thresh: null for exact grouping)")
            reps = clusters.setdefault(gids[i], [])
            for rep, cid in reps:
                if SequenceMatcher(None, o, rep).ratio() >= self.similarity_thresh:
                    out.append(cid)
                    break
            else:
                reps.append((o, n_ids))
                out.append(n_ids)
                n_ids += 1
        return out

    def assign(self, batch: RolloutBatch, seq_advantages: Tensor, signals: dict[Signal, Tensor]) -> CreditOutput:
        n, present, r = turn_layout(batch, "gigpo")
        obs = batch.meta.get("anchor_obs")
        if obs is None:
            raise ValueError("gigpo needs batch.meta['anchor_obs'] (per row, the observation before each turn) "
                             "to build step groups; the multi-turn rollout must record it")
        B, K = r.shape
        n_list = n.tolist()
        for i in range(B):
            if len(obs[i]) != n_list[i]:
                raise ValueError(f"gigpo: anchor_obs[{i}] has {len(obs[i])} observations but row {i} has "
                                 f"{n_list[i]} turn(s) by turn_rewards")
        gen = batch.response_mask
        dev = gen.device
        r, n = r.to(dev), n.to(dev)
        gids = batch.group_ids.to(dev)
        scale = self.mode == "mean_std_norm"
        outcome = batch.rewards.to(dev).float()

        # step rewards r̃ and the episode return R(τ)
        step_r = r.clone()
        if self.outcome_in_returns:
            last = (n - 1).clamp_min(0)
            has = (n > 0).float()
            step_r.scatter_add_(1, last[:, None], (outcome * has)[:, None])
            ep_return = outcome + r.sum(1)
        else:
            ep_return = outcome

        # Eq. 3: episode advantage
        if self.cross_steps:
            rows = torch.arange(B, device=dev).repeat_interleave(n)
            a_e = torch.zeros(B, device=dev)
            if rows.numel():
                a_e[rows] = group_advantages(ep_return[rows], gids[rows], scale_by_std=scale, eps=self.eps)
        else:
            a_e = group_advantages(ep_return, gids, scale_by_std=scale, eps=self.eps)

        # Eq. 5: discounted step returns, 0 for turns that did not happen
        ret = torch.zeros_like(step_r)
        run = torch.zeros(B, device=dev)
        for k in reversed(range(K)):
            run = step_r[:, k] + self.gamma * run
            ret[:, k] = run
        ret = torch.where(present.to(dev), ret, torch.zeros_like(ret))

        # Eq. 6-7: step groups and step advantages
        items = [(i, k) for i in range(B) for k in range(n_list[i])]
        a_s = torch.zeros_like(ret)
        metrics: dict[str, float] = {"turns_mean": float(n.float().mean()) if B else 0.0}
        if items:
            sg = torch.tensor(self._step_groups(items, obs, batch.group_ids.tolist()), device=dev)
            ii = torch.tensor([i for i, _ in items], device=dev)
            kk = torch.tensor([k for _, k in items], device=dev)
            a_s[ii, kk] = group_advantages(ret[ii, kk], sg, scale_by_std=scale, eps=self.eps, singleton="zero")
            sizes = torch.bincount(sg).float()
            metrics["step_group_size_mean"] = float(sizes.mean())
            metrics["singleton_step_frac"] = float((sizes[sg] == 1).float().mean())

        # Eq. 8
        step_tok = self.step_coef * per_token(a_s, batch)
        adv = torch.where(gen, a_e[:, None] + step_tok, torch.zeros_like(step_tok))
        m = gen.float()
        metrics["step_term_abs_mean"] = float((step_tok.abs() * m).sum() / m.sum().clamp_min(1))
        return CreditOutput(token_advantages=adv, metrics=metrics)
