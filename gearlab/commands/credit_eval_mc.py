"""``credit_eval.truth=mc``: credit scored against Monte-Carlo step values, on any task with a verifier.

Each response of the credit-eval batch is continued ``credit_eval.mc_k`` times from the end of each of its steps
(``gearlab.signals.mc``: V_j, its standard error, the step advantage A_j = V_j − V_{j−1}). In a failed response the
step with the largest value drop is its **MC onset**, where it went wrong by this measure; a drop smaller than
two standard errors (of the two values it compares) is not an onset. The methods are then scored with the located-
error scores of ``gearlab.credit.scoring`` with the onset step's tokens standing for the located error (AUROC of
blame at the onset step against the steps before it, blame ratio, prefix share, onset precision / recall), and:

- ``rank_corr``: per response with at least three steps, the Spearman correlation between a method's mean credit
  on each step and the MC step advantages, averaged over responses (NaN for a method whose credit is constant within
  a response, e.g. GRPO: it ranks no step above another);
- ``agreement`` (tasks that also locate errors): among failed responses with both a located error and an MC
  onset, the share whose onset step holds the first located error token — a check of the MC ground truth itself.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import Tensor

from gearlab.rollout.base import SamplingParams
from gearlab.rollout.mc import mc_values
from gearlab.signals.mc import StepValues


def onset_mask(values: Sequence[StepValues], rewards: Tensor, response_mask: Tensor) -> Tensor:
    """[B, T] bool: the generated tokens of each failed response's MC onset step (none where no step's value
    drops by more than two standard errors)."""
    out = torch.zeros(response_mask.shape, dtype=torch.bool)
    for b, sv in enumerate(values):
        if float(rewards[b]) >= 1 - 1e-6:
            continue
        j = sv.onset
        prev_se = sv.v0_stderr if j == 0 else sv.stderr[j - 1]
        if -sv.advantages[j] <= 2 * math.hypot(prev_se, sv.stderr[j]):
            continue
        pos = response_mask[b].nonzero().flatten().cpu()
        start = 0 if j == 0 else sv.ends[j - 1]
        out[b, pos[start : sv.ends[j]]] = True
    return out.to(response_mask.device)


def _ranks(x: Tensor) -> Tensor:
    """Ranks 0..n-1 of x [n], ties sharing their mean rank."""
    r = torch.empty(x.numel(), dtype=torch.float64)
    r[x.argsort()] = torch.arange(x.numel(), dtype=torch.float64)
    for v in x.unique():
        tie = x == v
        r[tie] = r[tie].mean()
    return r


def _constant(x: Tensor) -> bool:
    """Equal up to float rounding (per-step means of one value over steps of different lengths differ in the last
    bits)."""
    return float(x.max() - x.min()) <= 1e-6 * (float(x.abs().max()) + 1e-12)


def _spearman(x: Tensor, y: Tensor) -> float:
    """Spearman's rank correlation of two [n] vectors; NaN for n < 3 or a constant one."""
    if x.numel() < 3 or _constant(x) or _constant(y):
        return math.nan
    return float(torch.corrcoef(torch.stack([_ranks(x), _ranks(y)]))[0, 1])


def rank_correlations(values: Sequence[StepValues], credit: dict[str, Tensor], response_mask: Tensor
                      ) -> dict[str, dict[str, float]]:
    """{method: {"rank_corr": mean Spearman over responses, "n": responses it was defined on}}."""
    out: dict[str, dict[str, float]] = {}
    for name, adv in credit.items():
        rs = []
        for b, sv in enumerate(values):
            if len(sv.ends) < 3:
                continue
            row = adv[b][response_mask[b]].float().cpu()
            starts = [0, *sv.ends[:-1]]
            per_step = torch.stack([row[s:e].mean() for s, e in zip(starts, sv.ends)])
            r = _spearman(per_step, torch.tensor(sv.advantages))
            if not math.isnan(r):
                rs.append(r)
        out[name] = {"rank_corr": sum(rs) / len(rs) if rs else math.nan, "n": len(rs)}
    return out


def kl_peak_offsets(values: Sequence[StepValues], kl: Tensor, onset: Tensor, response_mask: Tensor
                    ) -> dict[str, Any]:
    """GEAR's premise against the MC onset: in each response with an onset, the step holding the largest teacher KL
    minus the onset step. Returns the histogram of offsets (clipped to ±3), the share of KL peaks inside the onset
    step, and the chance rate of that share (the mean of 1 / steps: a peak on a uniformly random step)."""
    offsets: list[int] = []
    chance: list[float] = []
    for b, sv in enumerate(values):
        if not bool(onset[b].any()):
            continue
        row = kl[b][response_mask[b]].float().cpu()
        peak = int(row.argmax())
        step = next(j for j, e in enumerate(sv.ends) if peak < e)
        offsets.append(step - sv.onset)
        chance.append(1.0 / len(sv.ends))
    n = len(offsets)
    hist = {str(d): sum(1 for o in offsets if max(-3, min(3, o)) == d) for d in range(-3, 4)}
    return {"n": n, "offset_hist": hist, "share_in_onset_step": hist["0"] / n if n else math.nan,
            "chance": sum(chance) / n if n else math.nan}


def mc_truth(rb: Any, rows: Sequence[Any], names: list[str], res: dict[str, Any], *, engine: Any, model: Any,
             sampling: SamplingParams, k: int, max_steps: int, seed: int, located: Tensor | None,
             score_batch: Any) -> dict[str, Any]:
    """The ``mc`` part of the credit-eval record: MC values of every response of ``rb`` (``rows``: one Problem per
    row), the methods and signals scored against the MC onsets (``score_batch``: credit_eval's), the rank
    correlations, the agreement with the located errors (``located`` [B, T] bool, or None) and the cost."""
    values, cost = mc_values(engine, model, rows, rb, k=k, max_steps=max_steps, sampling=sampling,
                             seed=seed + (1 << 41))
    onset = onset_mask(values, rb.rewards, rb.response_mask)
    has = onset.any(dim=1)
    informative = has & (res["seq_adv"] != 0)
    rec: dict[str, Any] = {"k": k, "max_steps": max_steps, "n_failed": int((rb.rewards < 1 - 1e-6).sum()),
                           "n_with_onset": int(has.sum()), "n_onset_informative": int(informative.sum()),
                           **score_batch(rb, names, res, onset),
                           "rank_corr": rank_correlations(values, res["credit"], rb.response_mask),
                           "cost": cost}
    if "kl" in res["signals"]:
        rec["kl_peak"] = kl_peak_offsets(values, res["signals"]["kl"], onset, rb.response_mask)
    if located is not None:
        first = located.bool() & (located.long().cumsum(dim=1) == 1)
        both = has & located.any(dim=1)
        hit = (first & onset).any(dim=1) & both
        n = int(both.sum())
        rec["agreement"] = {"n": n, "onset_holds_first_error": float(hit.sum()) / n if n else math.nan}
    return rec


def markdown(mc: dict[str, Any], fmt: Any) -> str:
    """The MC table (``fmt``: credit_eval's number format)."""
    lines = [f"credit vs Monte-Carlo onsets — K = {mc['k']} continuations per step end, {mc['n_failed']} failed, "
             f"{mc['n_with_onset']} with an onset (a drop > 2 SE), {mc['n_onset_informative']} of them with A ≠ 0",
             "", "| method | AUROC | blame ratio | prefix share | onset P | onset R | rank corr. with A_MC (n) | n |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in mc["assigners"].items():
        rc = mc["rank_corr"].get(name, {})
        lines.append(f"| {name} | {fmt(s.get('auroc'))} | {fmt(s.get('blame_ratio'))} | {fmt(s.get('prefix_share'))} | "
                     f"{fmt(s.get('onset_precision'))} | {fmt(s.get('onset_recall'))} | "
                     f"{fmt(rc.get('rank_corr'))} ({rc.get('n', 0)}) | {s.get('n', 0)} |")
    for name, s in mc["signals"].items():
        lines.append(f"| signal: {name} | {fmt(s.get('auroc'))} | | | | | | {s.get('n', 0)} |")
    if "kl_peak" in mc and mc["kl_peak"]["n"]:
        k = mc["kl_peak"]
        hist = ", ".join(f"{d}: {c}" for d, c in k["offset_hist"].items())
        lines.append(f"\nTeacher-KL peak vs MC onset ({k['n']} responses): the peak lies in the onset step in "
                     f"{fmt(k['share_in_onset_step'])} of them (chance {fmt(k['chance'])}); offsets in steps, ±3 = "
                     f"3 or more: {hist}.")
    if "agreement" in mc:
        a = mc["agreement"]
        lines.append(f"\nMC onset vs located first error: the onset step holds the first wrong token in "
                     f"{fmt(a['onset_holds_first_error'])} of {a['n']} responses.")
    c = mc["cost"]
    lines.append(f"\nCost: {c['continuations']} continuations, {c['tokens']} generated tokens, {c['seconds']:.1f} s.")
    return "\n".join(lines)
