"""What a credit method did to GRPO's advantages, per iteration: the statistics that make a drifting mean, a
silent change of normalisation scope or a method that flips signs visible on the record (logged under
``credit/`` by the trainer for every method, GRPO included).

Conventions: the *effective* credit of a token is its advantage times its loss mask (a token outside the loss
gets 0); every statistic is over the generated tokens (``response_mask``); the reference is GRPO's broadcast
A_{i,t} = A_i. Standard deviations are unbiased (n − 1). The comparison uses a relative tolerance of 1e-6 so
that a method returning GRPO's values up to float rounding counts as unchanged.
"""
from __future__ import annotations

from torch import Tensor

REL_TOL = 1e-6


def credit_diagnostics(
    token_adv: Tensor, seq_adv: Tensor, response_mask: Tensor, loss_mask: Tensor
) -> dict[str, float]:
    """token_adv [B, T] float, seq_adv [B] (GRPO's A_i), response_mask / loss_mask [B, T] bool → scalars:

    adv_mean, adv_std, adv_abs_mean   of the effective token credit E_{i,t} over generated tokens
    abs_up_frac / abs_down_frac        shares of generated tokens with |E_{i,t}| above / below |A_i|
    sign_flip_frac                     share of generated tokens with A_i ≠ 0 whose E_{i,t} has the opposite sign
    zero_frac                          share of generated tokens with E_{i,t} = 0 where A_i ≠ 0 (credit removed)
    All 0.0 when the batch has no generated token."""
    m = response_mask.bool()
    n = int(m.sum())
    if n == 0:
        return dict.fromkeys(("adv_mean", "adv_std", "adv_abs_mean", "abs_up_frac", "abs_down_frac",
                              "sign_flip_frac", "zero_frac"), 0.0)
    e = (token_adv.float() * loss_mask.to(token_adv.device).float())[m]
    a = seq_adv.float().to(token_adv.device)[:, None].expand_as(token_adv)[m]
    tol = REL_TOL * a.abs().clamp_min(1e-12)
    diff = e.abs() - a.abs()
    return {
        "adv_mean": float(e.mean()),
        "adv_std": float(e.std()) if n > 1 else 0.0,
        "adv_abs_mean": float(e.abs().mean()),
        "abs_up_frac": float((diff > tol).float().mean()),
        "abs_down_frac": float((diff < -tol).float().mean()),
        "sign_flip_frac": float(((a != 0) & (e * a.sign() < 0)).float().mean()),
        "zero_frac": float(((a != 0) & (e == 0)).float().mean()),
    }


def normalisation_scope(scale_by_std: bool, std_scope: str, leave_one_out: bool) -> str:
    """The advantage normalisation a run used, in words (a run parameter): the baseline's scope and the std's."""
    base = "leave-one-out group mean" if leave_one_out else "group mean"
    if not scale_by_std:
        return f"{base}, no std scaling"
    std = "the other group members' std" if leave_one_out else f"{std_scope} std (unbiased)"
    return f"{base}, divided by {std}"
