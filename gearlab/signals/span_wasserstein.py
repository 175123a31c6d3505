"""``span_wasserstein``: SHEAR's token weights from span-level Wasserstein distances between the hidden states of a
group's correct and incorrect responses (arXiv 2604.23318; docs/credit/shear.md). A **reconstruction**: the
authors released no code and only the paper's abstract was readable here; the steps below follow third-party
restatements of its Algorithm 1, and every choice they leave open is tagged [PROPOSED] in the docs page.

Per group with both outcomes (correct: reward > ``correct_threshold``), on the final hidden states h_t of the
response tokens (the vectors the LM head reads, at each token's own position), no gradient:

    spans     S_k = [k·s, k·s + w) cut at the response's end, the fewest that cover it (w, s: span_len, stride)
    n̄        mean ‖h_t‖₂ over every response token of the group; h ← h / n̄
    d_k^(i)   min over the responses j of the other outcome and all their spans l of W_ε(S_k^(i), S_l^(j))
    ω_t^(i)   max over the spans k covering token t of d_k^(i)

W_ε is the entropic Wasserstein-1 distance (Euclidean cost, uniform mass on a span's tokens, log-domain Sinkhorn,
the regularised objective ⟨π, C⟩ + ε KL(π ‖ a ⊗ b)) with ε = ``eps_relative`` in units of n̄. Responses of a group
with one outcome only (or whose opposing responses are all empty) get ω = 1; positions outside the response 0.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from gearlab.core.logprobs import position_ids_from_mask
from gearlab.signals.registry import SignalContext, register_signal
from gearlab.signals.saliency import _base

SPAN_WASSERSTEIN = "span_wasserstein"


def span_starts(length: int, span_len: int, stride: int) -> tuple[Tensor, Tensor]:
    """(starts [K], lengths [K]) of the spans of a response of ``length`` tokens: windows of ``span_len`` every
    ``stride`` tokens, the fewest that cover it (only the last may be shorter); one span if length ≤ span_len."""
    if length <= 0:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    n = 1 if length <= span_len else math.ceil((length - span_len) / stride) + 1
    starts = torch.arange(n, dtype=torch.long) * stride
    return starts, (length - starts).clamp(max=span_len)


def sinkhorn_w1(cost: Tensor, mask_a: Tensor, mask_b: Tensor, eps: float, iters: int = 200,
                tol: float = 1e-4) -> Tensor:
    """Entropic W1 [N] between uniform measures on the valid points (masks [N, m], [N, n]) under ``cost``
    [N, m, n]: the objective ⟨π, C⟩ + ε KL(π ‖ a ⊗ b) at the log-domain Sinkhorn plan. Each of the N problems
    stops on its own, once its row marginals are within ``tol`` (L1; checked every 10 iterations) or after ``iters``
    iterations, so a problem's value does not depend on which others share the batch. W1 ≤ value ≤ W1 + ε log n."""
    both = mask_a[:, :, None] & mask_b[:, None, :]
    cost = torch.where(both, cost, torch.zeros_like(cost))
    ninf = torch.tensor(float("-inf"), dtype=cost.dtype, device=cost.device)
    la = torch.where(mask_a, -torch.log(mask_a.sum(1, keepdim=True).to(cost.dtype)), ninf)
    lb = torch.where(mask_b, -torch.log(mask_b.sum(1, keepdim=True).to(cost.dtype)), ninf)
    f, g = torch.zeros_like(la), torch.zeros_like(lb)
    done = torch.zeros(cost.shape[0], 1, dtype=torch.bool, device=cost.device)
    k = -cost / eps

    def log_plan() -> Tensor:
        return la[:, :, None] + lb[:, None, :] + k + (f[:, :, None] + g[:, None, :]) / eps

    for it in range(iters):
        f = torch.where(done, f, -eps * torch.logsumexp(k + (g / eps + lb)[:, None, :], dim=2))
        g = torch.where(done, g, -eps * torch.logsumexp(k + (f / eps + la)[:, :, None], dim=1))
        if it % 10 == 9:
            done |= ((log_plan().logsumexp(2).exp() - la.exp()).abs().sum(1, keepdim=True) < tol)
            if bool(done.all()):
                break
    logp = log_plan()
    plan = logp.exp()
    kl = torch.where(plan > 0, plan * (logp - la[:, :, None] - lb[:, None, :]), torch.zeros_like(plan))
    return (plan * cost).sum((1, 2)) + eps * kl.sum((1, 2))


def _span_index(n: int, span_len: int, stride: int) -> tuple[Tensor, Tensor]:
    """[K, w] token indices (0 where padded) and validity of every span of a response of n tokens."""
    starts, lens = span_starts(n, span_len, stride)
    off = torch.arange(span_len)
    valid = off[None] < lens[:, None]
    return torch.where(valid, starts[:, None] + off[None], 0), valid


# span pairs whose cost blocks are solved at once: 2**24 cost entries (64 MiB in float32; the Sinkhorn loop holds a
# few tensors of that size). All pairs at once would take ~0.5 GB per response pair at 3,000 tokens (w 100, s 25).
PAIR_CHUNK_ELEMENTS = 1 << 24


def span_distances(xa: Tensor, xb: Tensor, span_len: int, stride: int, eps: float, iters: int = 200,
                   tol: float = 1e-4, chunk_elements: int = PAIR_CHUNK_ELEMENTS) -> Tensor:
    """[K_a, K_b]: W_ε between every span of response a ([T_a, H]) and every span of response b ([T_b, H]), the
    span pairs solved ``chunk_elements // span_len²`` at a time (the values do not depend on it)."""
    ia, va = (t.to(xa.device) for t in _span_index(xa.shape[0], span_len, stride))
    ib, vb = (t.to(xa.device) for t in _span_index(xb.shape[0], span_len, stride))
    d = torch.cdist(xa[None], xb[None])[0]
    ka, kb = ia.shape[0], ib.shape[0]
    pairs = torch.arange(ka * kb, device=xa.device)
    step = max(1, chunk_elements // (span_len * span_len))
    out = []
    for p in pairs.split(step):
        a, b = p // kb, p % kb
        cost = d[ia[a][:, :, None], ib[b][:, None, :]]  # [n, w, w]
        out.append(sinkhorn_w1(cost, va[a], vb[b], eps, iters, tol))
    return torch.cat(out).reshape(ka, kb)


@torch.no_grad()
def shear_weights(hidden: Tensor, mask: Tensor, rewards: Tensor, group_ids: Tensor, *, span_len: int = 100,
                  stride: int = 25, eps_relative: float = 0.02, iters: int = 200, correct_threshold: float = 0.5
                  ) -> Tensor:
    """ω [B, T] float32 (module docstring) from the response hidden states [B, T, H], the response mask [B, T],
    rewards [B] and group ids [B]."""
    B, T, _ = hidden.shape
    mask = mask.bool()
    out = torch.zeros(B, T, dtype=torch.float32, device=hidden.device)
    correct = rewards.float().to(hidden.device) > correct_threshold
    for gid in torch.unique(group_ids).tolist():
        members = (group_ids == gid).nonzero().flatten().tolist()
        pos = {i: mask[i].nonzero().flatten() for i in members}
        good = [i for i in members if correct[i] and pos[i].numel()]
        bad = [i for i in members if not correct[i] and pos[i].numel()]
        if not good or not bad:
            for i in members:
                out[i, pos[i]] = 1.0
            continue
        xs = {i: hidden[i, pos[i]].float() for i in good + bad}
        nbar = torch.cat([hidden[i, pos[i]].float().norm(dim=-1) for i in members]).mean().clamp_min(1e-12)
        xs = {i: x / nbar for i, x in xs.items()}
        dmin = {i: torch.full((span_starts(xs[i].shape[0], span_len, stride)[0].numel(),), float("inf"),
                              device=hidden.device) for i in good + bad}
        for i in good:
            for j in bad:  # W_ε between uniform measures is symmetric: one matrix serves both sides
                d = span_distances(xs[i], xs[j], span_len, stride, eps_relative, iters)
                dmin[i] = torch.minimum(dmin[i], d.min(1).values)
                dmin[j] = torch.minimum(dmin[j], d.min(0).values)
        for i in good + bad:
            idx, valid = (t.to(hidden.device) for t in _span_index(pos[i].numel(), span_len, stride))
            vals = dmin[i][:, None].expand_as(idx)
            tok = torch.zeros(pos[i].numel(), device=hidden.device).scatter_reduce(
                0, idx[valid], vals[valid], reduce="amax", include_self=False)
            out[i, pos[i]] = tok
    return out


@register_signal(SPAN_WASSERSTEIN, fake="nonneg")
def span_wasserstein(ctx: SignalContext) -> Tensor:
    """SHEAR's ω: the span-level Wasserstein distance of each token's spans to the group's other outcome ([B, T])."""
    b, o = ctx.batch, ctx.options
    P, T = b.prompt_ids.shape[1], b.response_ids.shape[1]
    hs = []
    for s in range(0, b.batch_size, max(1, int(ctx.micro_batch_size))):
        rows = torch.arange(s, min(s + max(1, int(ctx.micro_batch_size)), b.batch_size), device=b.response_ids.device)
        mb = b.select(rows)
        mask = mb.full_attention_mask()
        h = _base(ctx.model)(input_ids=mb.input_ids(), attention_mask=mask, position_ids=position_ids_from_mask(mask),
                             use_cache=False).last_hidden_state
        hs.append(h[:, P : P + T].float())
    return shear_weights(torch.cat(hs), b.response_mask, b.rewards, b.group_ids,
                         span_len=int(o.get("span_len", 100)), stride=int(o.get("stride", 25)),
                         eps_relative=float(o.get("eps_relative", 0.02)), iters=int(o.get("sinkhorn_iters", 200)),
                         correct_threshold=float(o.get("correct_threshold", 0.5)))
