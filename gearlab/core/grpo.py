"""GRPO maths: group-relative advantages, the clipped surrogate, loss aggregation, KL estimators.

Torch only, no Lightning, so every formula can be pinned against reference implementations
(verl, TRL, NeMo-RL) in unit tests. Shapes: B sequences, T response positions.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from gearlab.core.reduce import bin_sum

__all__ = ["AGG_MODES", "KL_KINDS", "group_advantages", "zero_std_fraction", "aggregate",
           "policy_loss", "kl_penalty"]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
_KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
_KL_BASE = ("k1", "k2", "k3", "abs")
KL_KINDS = _KL_BASE + tuple(k + "+" for k in _KL_BASE) + tuple(_KL_ALIASES)
Count = Union[int, float, Tensor]


def _group_stats(r: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per-sample index into dense group ids, and per-group count, sum, min, max."""
    _, inv = torch.unique(group_ids, return_inverse=True)  # arbitrary ids -> 0..G-1
    n = int(inv.max()) + 1
    count = torch.bincount(inv, minlength=n).to(r.dtype)  # integers: exact in any order
    total = bin_sum(r, inv, n)
    gmin = r.new_full((n,), float("inf")).scatter_reduce_(0, inv, r, "amin")
    gmax = r.new_full((n,), float("-inf")).scatter_reduce_(0, inv, r, "amax")
    return inv, count, total, gmin, gmax


def _sqrt(x: Tensor) -> Tensor:
    """sqrt, correctly rounded on every device. torch's float32 CPU sqrt goes through MKL's vector maths, which is
    not correctly rounded and differs in the last bit between Intel and AMD CPUs (experiments/cpu_vml_probe.py: 8%
    of inputs); the float64 sqrt rounded back is the correctly rounded float32 (as CUDA's sqrt) everywhere."""
    return x.double().sqrt().to(x.dtype)


def group_advantages(rewards: Tensor, group_ids: Tensor, *, scale_by_std: bool = True,
                     eps: float = 1e-6, leave_one_out: bool = False, std_scope: str = "group",
                     singleton: str = "raw") -> Tensor:
    """Sequence-level GRPO advantage of every sample, relative to its group (same prompt).

    rewards [B] float, group_ids [B] long (any values; equal id = same group) -> [B].

    Default (verl ``compute_grpo_outcome_advantage``): A = (R - mean_g) / (std_g + eps) with the
    UNBIASED (Bessel, n-1) std of the group, eps = 1e-6. Variants:
      scale_by_std=False   Dr.GRPO: A = R - baseline (no division).
      std_scope="batch"    TRL scale_rewards="batch": group baseline, unbiased std of all B rewards.
      leave_one_out=True   NeMo-RL: baseline = mean of the OTHER n-1 members of the group; std =
                           unbiased std of those same n-1 others (0 when fewer than two others),
                           and the division by (std + eps) is skipped where that std is 0. With
                           scale_by_std=False this is RLOO (= n/(n-1) (R - mean_g)).
    A group whose rewards are all equal gets exactly 0. A singleton group gets
    singleton="raw": verl's mean 0 / std 1, i.e. R / (1 + eps) (R without std scaling), or
    singleton="zero": TRL's 0. TRL's epsilon is 1e-4; pass eps=1e-4 to match it.
    """
    if std_scope not in ("group", "batch"):
        raise ValueError(f"std_scope must be 'group' or 'batch', got {std_scope!r}")
    if singleton not in ("raw", "zero"):
        raise ValueError(f"singleton must be 'raw' or 'zero', got {singleton!r}")
    r = rewards if rewards.is_floating_point() else rewards.float()
    if r.numel() == 0:
        return r.clone()
    inv, count, total, gmin, gmax = _group_stats(r, group_ids)
    n, lo, hi = count[inv], gmin[inv], gmax[inv]
    dev = r - (total / count)[inv]
    # Two-pass sum of squares: E[x^2] - E[x]^2 cancels badly for near-equal rewards.
    ss = bin_sum(dev * dev, inv, count.numel())[inv]
    if leave_one_out:
        n_o = n - 1
        n_lo = torch.bincount(inv[r == lo], minlength=count.numel()).to(r.dtype)[inv]
        n_hi = torch.bincount(inv[r == hi], minlength=count.numel()).to(r.dtype)[inv]
        # Decided exactly, not from the downdated variance: its rounding residue (~1e-9)
        # would pass the std > 0 test and divide a finite advantage by ~1e-5.
        others_equal = ((lo == hi) | ((r == hi) & (n_hi == 1) & (n_lo == n_o))
                        | ((r == lo) & (n_lo == 1) & (n_hi == n_o)))
        base = torch.where(others_equal, torch.where(r == hi, lo, hi),
                           (total[inv] - r) / n_o.clamp_min(1))
        adv = r - base
        # Removing x_i from a sample of n changes its sum of squares by n/(n-1) * (x_i - mean)^2.
        ss_o = (ss - dev * dev * n / n_o.clamp_min(1)).clamp_min(0)
        std = torch.where(others_equal | (n_o < 2), torch.zeros_like(r),
                          _sqrt(ss_o / (n_o - 1).clamp_min(1)))
        if scale_by_std and std_scope == "group":
            adv = torch.where(std > 0, adv / (std + eps), adv)
    else:
        adv = dev
        if scale_by_std and std_scope == "group":
            adv = adv / (_sqrt(ss / (n - 1).clamp_min(1)) + eps)
    if scale_by_std and std_scope == "batch":
        batch_std = r.std() if r.numel() > 1 else r.new_zeros(())
        adv = adv / (batch_std + eps)
    adv = torch.where(lo == hi, torch.zeros_like(adv), adv)
    if singleton == "raw":
        raw = r / (1.0 + eps) if scale_by_std else r
    else:
        raw = torch.zeros_like(r)
    return torch.where(n == 1, raw, adv)


def zero_std_fraction(rewards: Tensor, group_ids: Tensor) -> float:
    """Fraction of groups of size > 1 whose rewards are all equal (TRL's frac_reward_zero_std).

    rewards [B], group_ids [B] long -> float in [0, 1]; 0.0 when no group has two members.
    These groups get A = 0 but still enter the token counts of the loss normalisers.
    """
    r = rewards if rewards.is_floating_point() else rewards.float()
    if r.numel() == 0:
        return 0.0
    _, count, _, gmin, gmax = _group_stats(r, group_ids)
    multi = count > 1
    n_multi = int(multi.sum())
    return float(((gmin == gmax) & multi).sum()) / n_multi if n_multi else 0.0


def aggregate(loss_mat: Tensor, mask: Tensor, agg: str, *, global_tokens: Optional[Count] = None,
              global_seqs: Optional[Count] = None, loss_scale_factor: Optional[float] = None,
              dp_size: int = 1) -> Tensor:
    """Reduce a per-token loss [B, T] under mask [B, T] (bool or float) to a scalar.

    agg (verl's loss_agg_mode names):
      "token-mean"               sum(m L) / N_tok                                  (DAPO, TRL dapo)
      "seq-mean-token-mean"      sum_i [sum_t m L / sum_t m] / N_seq               (original GRPO)
      "seq-mean-token-sum"       sum(m L) / N_seq
      "seq-mean-token-sum-norm"  sum(m L) / loss_scale_factor, default T = mask.shape[-1]; NOT
                                 divided by B (Dr.GRPO, verl <= 0.7; verl >= 0.8 also divides by
                                 N_seq: pass loss_scale_factor = T * N_seq to get that)
    N_tok / N_seq default to the local counts (sequences with no unmasked token are not counted
    and contribute 0). For gradient accumulation and data parallelism pass global_tokens /
    global_seqs = the count over ALL micro-batches and ALL ranks of the optimizer step: summing
    micro-batch gradients then gives the full-batch gradient. The result is multiplied by dp_size
    because DDP averages gradients over ranks (verl's convention); dp_size > 1 therefore requires
    the global count the mode uses.
    """
    if agg not in AGG_MODES:
        raise ValueError(f"unknown agg {agg!r}; expected one of {', '.join(AGG_MODES)}")
    m = mask.to(loss_mat.dtype)
    # where, not multiply: padding may hold inf/nan (e.g. -inf log-probs), and 0 * inf = nan.
    masked = torch.where(m != 0, loss_mat * m, torch.zeros_like(loss_mat))
    if agg == "seq-mean-token-sum-norm":
        scale = mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        return masked.sum() / scale * dp_size
    if agg == "token-mean":
        if global_tokens is None and dp_size > 1:
            raise ValueError("token-mean with dp_size > 1 needs global_tokens")
        n_tok = m.sum().clamp_min(1) if global_tokens is None else global_tokens
        return masked.sum() / n_tok * dp_size
    if global_seqs is None and dp_size > 1:
        raise ValueError(f"{agg} with dp_size > 1 needs global_seqs")
    tok_per_seq = m.sum(-1)
    n_seq = (tok_per_seq > 0).sum().clamp_min(1) if global_seqs is None else global_seqs
    if agg == "seq-mean-token-sum":
        return masked.sum() / n_seq * dp_size
    # A safe denominator, so an empty row gives 0 (and a 0 gradient) instead of 0/0.
    denom = torch.where(tok_per_seq > 0, tok_per_seq, torch.ones_like(tok_per_seq))
    per_seq = masked.sum(-1) / denom
    return per_seq.sum() / n_seq * dp_size


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: Optional[float] = None,
                agg: str = "token-mean", global_tokens: Optional[Count] = None,
                global_seqs: Optional[Count] = None, loss_scale_factor: Optional[float] = None,
                dp_size: int = 1, is_weights: Optional[Tensor] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO/GRPO clipped surrogate (verl ``compute_policy_loss_vanilla``), reduced by ``aggregate``.

    logprobs, old_logprobs, advantages, mask: [B, T] (advantages may be [B, 1]).
    r = exp(clamp(logp - old, -20, 20)); L = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)).
    DAPO clip-higher is clip_low=0.2, clip_high=0.28. dual_clip=c (> 1, verl uses 3.0) caps the
    loss of A < 0 tokens at -A c (dual-clip PPO); None disables it (verl always applies it).
    is_weights [B, T] or None: per-token importance weights multiplied into the clipped term, no gradient
    through them (truncated IS against the rollout engine: min(π_old / π_engine, C), verl's TIS).
    Returns (scalar loss, metrics); metrics are detached scalar token-means over the LOCAL mask:
      clipfrac       tokens where the clipped term is strictly larger (its gradient is cut)
      clipfrac_high  of those, A > 0 with r > 1 + clip_high
      clipfrac_low   of those, A < 0 with r < 1 - clip_low   (high + low = clipfrac)
      dual_clipfrac  A < 0 tokens where the dual-clip cap binds (verl's "pg_clipfrac_lower")
      approx_kl      mean(old - logp) on the clamped log-ratio (verl's ppo_kl, a k1 estimate)
      ratio_mean     mean r
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)  # exp overflow guard, as verl
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_tok = torch.maximum(unclipped, clipped)
    neg = advantages < 0
    dual_active = torch.zeros_like(neg)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual_active = neg & (per_tok > cap)
        per_tok = torch.where(neg, torch.minimum(per_tok, cap), per_tok)
    if is_weights is not None:
        per_tok = per_tok * is_weights.detach()
    loss = aggregate(per_tok, mask, agg, global_tokens=global_tokens, global_seqs=global_seqs,
                     loss_scale_factor=loss_scale_factor, dp_size=dp_size)
    with torch.no_grad():
        m = mask.to(per_tok.dtype)
        n = m.sum().clamp_min(1)

        def mmean(x: Tensor) -> Tensor:
            return (x.to(m.dtype) * m).sum() / n

        active = clipped > unclipped
        metrics = {
            "clipfrac": mmean(active),
            "clipfrac_low": mmean(active & neg),
            "clipfrac_high": mmean(active & (advantages > 0)),
            "dual_clipfrac": mmean(dual_active),
            "approx_kl": mmean(-log_ratio),
            "ratio_mean": mmean(ratio),
        }
    return loss, metrics


#: ``algorithm.engine_is``: how the policy-gradient term is corrected for rollouts sampled by another engine
ENGINE_IS_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "icepop")


def engine_mismatch(trainer_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor, mode: str = "none", *,
                    cap: float = 2.0, low: float = 0.5) -> tuple[Optional[Tensor], dict[str, Tensor]]:
    """Train/inference mismatch of the sampled tokens, and the importance weights that correct for it.

    trainer_logprobs (log π_old from the trainer's forward), engine_logprobs (the rollout engine's own log-probs
    of the same tokens), mask: [B, T]. Δ_t = trainer − engine (clamped to ±20), ρ_t = exp(Δ_t); a sequence's
    ratio is ρ_i = exp(mean_t Δ_{i,t}) over its masked tokens — the geometric mean of its token ratios, so it does
    not explode or vanish with the response's length as exp(Σ_t Δ) does. Weights w [B, T] by ``mode``:

      none               no weights (None)
      token_truncate     w_t = min(ρ_t, cap)                       (truncated IS; ``algorithm.tis_cap``)
      token_mask         w_t = ρ_t · 1[ρ_t ≤ cap]                  (tokens past the cap leave the gradient)
      sequence_truncate  w_t = min(ρ_i, cap) on every token of sequence i
      sequence_mask      w_t = ρ_i · 1[ρ_i ≤ cap]
      icepop             w_t = ρ_t · 1[low ≤ ρ_t ≤ cap]            (two-sided token mask)

    Masked tokens keep their place in the loss's token counts (the loss is not renormalised over the kept ones).
    Metrics (means over the mask): engine_lp_diff_abs (|Δ|), engine_lp_diff_max, engine_kl_k3 (mean ρ − 1 − Δ, a
    k3 estimate of KL(π_engine ‖ π_trainer)); with a mode: is_weight_mean, is_truncated_frac (tokens whose weight
    was capped), is_masked_frac (tokens given weight 0); sequence modes also is_seq_truncated_frac /
    is_seq_masked_frac (shares of sequences with at least one token).
    Returns (weights [B, T] detached, or None for ``none``; metrics)."""
    if mode not in ENGINE_IS_MODES:
        raise ValueError(f"engine_is mode must be one of {ENGINE_IS_MODES}, got {mode!r}")
    m = mask.bool()
    n = m.sum().clamp_min(1)
    with torch.no_grad():
        d = (trainer_logprobs - engine_logprobs).float().clamp(-20.0, 20.0)
        rho = d.exp()
        absd = d.abs() * m
        metrics = {"engine_lp_diff_abs": absd.sum() / n, "engine_lp_diff_max": absd.max() if m.any() else absd.sum(),
                   "engine_kl_k3": ((rho - 1 - d) * m).sum() / n}
        if mode == "none":
            return None, metrics
        zero = torch.zeros_like(rho)
        if mode.startswith("sequence"):
            per_seq = m.sum(-1)
            seq_d = (d * m).sum(-1) / per_seq.clamp_min(1)
            r = seq_d.exp()[:, None].expand_as(rho)
        else:
            r = rho
        if mode.endswith("truncate"):
            w, truncated, masked = r.clamp(max=cap), r > cap, torch.zeros_like(m)
        else:
            masked = (r > cap) | (r < low) if mode == "icepop" else r > cap
            w, truncated = torch.where(masked, zero, r), torch.zeros_like(m)
        w = w * m
        metrics.update(is_weight_mean=w.sum() / n, is_truncated_frac=(truncated & m).sum() / n,
                       is_masked_frac=(masked & m).sum() / n)
        if mode.startswith("sequence"):
            rows = (per_seq > 0).sum().clamp_min(1)
            metrics["is_seq_truncated_frac"] = (truncated & m).any(-1).sum() / rows
            metrics["is_seq_masked_frac"] = (masked & m).any(-1).sum() / rows
        return w, metrics


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs (Schulman 2020).

    logprobs, ref_logprobs [B, T] -> [B, T]; delta = logp - ref.
      "k1" (alias "kl")          delta
      "k2" (alias "mse")         delta^2 / 2
      "k3" (alias "low_var_kl")  exp(-delta) + delta - 1, with -delta clamped to [-20, 20] and the
                                 result to [-10, 10] (verl)
      "abs"                      |delta|
      "<kind>+"                  straight-through: forward value of <kind>, gradient of k2 (whose
                                 gradient is the unbiased one for the KL)
    Aggregate with ``aggregate(kl, mask, agg, ...)`` like the policy loss.
    """
    straight = kind.endswith("+")
    base = _KL_ALIASES.get(kind[:-1] if straight else kind, kind[:-1] if straight else kind)
    delta = logprobs - ref_logprobs
    if base == "k1":
        value = delta
    elif base == "k2":
        value = 0.5 * delta.square()
    elif base == "abs":
        value = delta.abs()
    elif base == "k3":
        neg = (-delta).clamp(-20.0, 20.0)
        value = (neg.exp() - neg - 1.0).clamp(-10.0, 10.0)
    else:
        raise ValueError(f"unknown KL kind {kind!r}; expected one of {', '.join(KL_KINDS)}")
    if not straight or base == "k2":
        return value
    k2 = 0.5 * delta.square()
    # Value is exactly `value`; the (k2 - k2.detach()) term is 0 but carries k2's gradient.
    return value.detach() + (k2 - k2.detach())
