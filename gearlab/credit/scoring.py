"""Credit scored against known errors: does a method put its blame on the step that was actually wrong?

Inputs are per-token tensors over the T response positions of a batch (``RolloutBatch`` layout):
  credit   [B, T] float  a method's effective token advantages (0 outside its loss mask)
  mask     [B, T] bool   response_mask: tokens the policy generated
  error    [B, T] bool   the tokens of the FIRST wrong step (``Task.locate_error`` mapped to tokens); all False
                         for a row whose error could not be located (or that was correct)
  active   [B]    bool   rows the method is scored on (callers pass A_i ≠ 0: a failed response in a group
                         where every response failed has no outcome signal, and GRPO gives it no credit at all)

Per scored trajectory the generated tokens split into the **prefix** (before the first error token: the steps
that were right), the **wrong step** (``error``) and what follows it. Blame = −advantage.

  auroc        P(blame of a wrong-step token > blame of a prefix token), ties counting one half (Mann–Whitney);
               uniform credit (GRPO) gives exactly 0.5
  blame_ratio  mean blame per token on the wrong step and after / mean blame per token on the prefix; GRPO
               gives exactly 1. Left out for a trajectory whose prefix blame is ≤ 0 (the ratio has no meaning)
  prefix_share the share of the trajectory's negative credit (Σ min(A_t, 0)) that lies on the prefix; GRPO gives
               the prefix's share of tokens. Left out for a trajectory with no negative credit
  onset_precision / onset_recall (segmenting methods: a [B, T] bool of segment onsets) — precision: of the onsets
               in scored trajectories, the share inside the wrong step; recall: the share of scored trajectories
               with at least one onset inside the wrong step

Every score is a mean over trajectories (onset precision: over onsets). Trajectories whose error is at the first
generated token have no prefix and are left out of auroc, blame_ratio and prefix_share (not of the onset scores).
A signal (KL, entropy, saliency; higher = more suspicious) is scored as a detector with the same ``auroc``.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["auroc", "credit_scores", "prefix_masks", "signal_auroc"]


def prefix_masks(mask: Tensor, error: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(prefix, from_error, located), [B, T], [B, T], [B]: the generated tokens before the first error token, the
    generated tokens from it on, and which rows have a located error at all."""
    mask, error = mask.bool(), error.bool() & mask.bool()
    located = error.any(dim=1)
    seen = error.long().cumsum(dim=1) > 0
    return mask & ~seen & located[:, None], mask & seen, located


def auroc(pos: Tensor, neg: Tensor) -> float:
    """P(x > y) + ½·P(x = y) for x from ``pos`` and y from ``neg`` (1-D), the Mann–Whitney statistic with average
    ranks for ties; NaN when either side is empty."""
    n1, n0 = pos.numel(), neg.numel()
    if n1 == 0 or n0 == 0:
        return float("nan")
    x = torch.cat([pos, neg]).double()
    order = torch.argsort(x, stable=True)
    xs = x[order]
    ranks = torch.empty_like(x)
    # average ranks over runs of equal values (1-based)
    _, inverse, counts = torch.unique_consecutive(xs, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    avg = ends - (counts.double() - 1) / 2
    ranks[order] = avg[inverse]
    r1 = ranks[:n1].sum().item()
    return (r1 - n1 * (n1 + 1) / 2) / (n1 * n0)


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def signal_auroc(signal: Tensor, mask: Tensor, error: Tensor) -> tuple[float, int]:
    """(mean per-trajectory AUROC of ``signal`` [B, T] as a detector of the wrong step against the prefix, number of
    trajectories scored). Higher signal = more suspicious."""
    prefix, _, _ = prefix_masks(mask, error)
    err = error.bool() & mask.bool()
    vals = [auroc(signal[i][err[i]], signal[i][prefix[i]]) for i in range(signal.shape[0]) if prefix[i].any()]
    return _mean(vals), len(vals)


def credit_scores(credit: Tensor, mask: Tensor, error: Tensor, active: Tensor,
                  onsets: Tensor | None = None) -> dict[str, float]:
    """The scores of the module docstring for one method. Returns ``auroc``, ``blame_ratio``, ``prefix_share``
    (means over the scored trajectories), ``n`` (trajectories with a prefix scored by auroc), ``n_blame_ratio``,
    and with ``onsets`` also ``onset_precision``, ``onset_recall``, ``n_onset``. NaN where nothing was scorable."""
    credit = credit.detach().double()
    mask, err = mask.bool(), error.bool() & mask.bool()
    prefix, after, located = prefix_masks(mask, err)
    rows = (located & active.bool()).nonzero().flatten().tolist()
    with_prefix = [i for i in rows if prefix[i].any()]
    blame = -credit
    au, ratio, share = [], [], []
    for i in with_prefix:
        au.append(auroc(blame[i][err[i]], blame[i][prefix[i]]))
        den = blame[i][prefix[i]].mean().item()
        if den > 1e-12:
            ratio.append(blame[i][after[i]].mean().item() / den)
        neg = credit[i].clamp(max=0.0) * mask[i]
        total = neg.sum().item()
        if total < -1e-12:
            share.append(neg[prefix[i]].sum().item() / total)
    out = {"auroc": _mean(au), "blame_ratio": _mean(ratio), "prefix_share": _mean(share), "n": len(au),
           "n_blame_ratio": len(ratio)}
    if onsets is not None:
        on = onsets.bool() & mask
        hit = sum(int((on[i] & err[i]).any()) for i in rows)
        n_on = sum(int(on[i].sum()) for i in rows)
        inside = sum(int((on[i] & err[i]).sum()) for i in rows)
        out.update(onset_precision=inside / n_on if n_on else float("nan"),
                   onset_recall=hit / len(rows) if rows else float("nan"), n_onset=len(rows))
    return out
