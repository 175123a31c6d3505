"""One pass over the vocabulary per draw: the tempered softmax, the row's uniform and the inverse CDF fused
(``rollout.fast.sampler=fused``, plain sampling only: no top-k / top-p, not greedy).

``gearlab.rollout.sampler.sample_rows`` draws from softmax(z), z = logits / T, with a two-level inverse CDF; on a
GPU that is several passes over the [B, 151,936] logits (the float32 cast, the division, the softmax's reads and
write, the block totals). Here the logits are read once: the vocabulary is cut into blocks of 128 tokens, and for
each block its maximum ``m_j`` and ``s_j = Σ exp(z - m_j)`` are kept ([B, blocks, 2], float32). With ``M = max_j m_j``
the block masses are ``s_j · exp(m_j - M)``; their running sum finds the block holding ``u · total``, the block's 128
logits are read again to find the token inside it, and the log-prob is ``z_tok - M - log(total)`` (log_softmax at
the token, over the whole vocabulary). The distribution is exactly softmax(z), as ``sample_rows``'s; the token is
the one ``sample_rows`` picks for the same uniform except where float rounding of the partial sums differs (a draw
within ~1e-7 of an interval's edge), and the target is clamped into the chosen block as there, so a draw never lands
on a token of zero probability.

Two Triton kernels on CUDA (``draw_triton``): the block statistics with a grid of (rows × vocabulary chunks), so
the pass over the logits keeps the whole card busy, then one program per row for the search. Fixed orders, no
atomics: deterministic. Elsewhere ``draw_reference`` runs, the same algorithm in PyTorch (the specification; the
kernels are tested against it through Triton's CPU interpreter, ``tests/rollout/test_fused_sample.py``).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from gearlab.rollout.kernels import kernel_available, triton
from gearlab.rollout.sampler import BLOCK  # tokens per block: the same blocks as sampler.inverse_cdf

_EDGE = 1.0 - 2.0**-23  # targets stay strictly inside an interval (sampler.inverse_cdf)
SAMPLERS = ("torch", "fused")  # rollout.fast.sampler


def draw_reference(logits: Tensor, u: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """logits [B, V] (any float dtype), u [B] float32 in [0, 1) → (tokens [B] int64, log-probs [B] float32 under
    log_softmax(logits / T)). The blockwise algorithm of the module docstring, in PyTorch."""
    z = logits.float() * (1.0 / temperature)  # (as the kernels: a product with the reciprocal)
    B, V = z.shape
    nb = math.ceil(V / BLOCK)
    zb = torch.nn.functional.pad(z, (0, nb * BLOCK - V), value=float("-inf")).view(B, nb, BLOCK)
    m = zb.amax(-1)  # [B, nb]
    s = torch.exp(zb - torch.where(torch.isinf(m), 0.0, m)[..., None]).sum(-1)  # 0 for a block of -inf only
    top = m.amax(-1, keepdim=True)
    mass = s * torch.exp(m - top)
    cdf = mass.cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None] * total, total * _EDGE)
    j = torch.searchsorted(cdf, target, right=True).clamp_(max=nb - 1)  # [B, 1]
    inside = torch.exp(zb.gather(1, j[:, :, None].expand(B, 1, BLOCK)).squeeze(1) - top).cumsum(-1)  # [B, BLOCK]
    before = cdf.gather(1, j) - mass.gather(1, j)
    r = torch.minimum((target - before).clamp_(min=0.0), inside[:, -1:] * _EDGE)
    tok = (j * BLOCK + torch.searchsorted(inside, r, right=True)).squeeze(-1)
    lp = z.gather(1, tok[:, None]).squeeze(-1) - top.squeeze(-1) - total.squeeze(-1).log()
    return tok, lp


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _block_stats(X, STATS, V, sx, inv_t, NB: tl.constexpr, PER: tl.constexpr, TB: tl.constexpr,
                     BLOCK_V: tl.constexpr):
        """Row b, blocks [c·PER, (c+1)·PER) in tiles of TB blocks: each block's max and Σ exp(z - max)."""
        b = tl.program_id(0).to(tl.int64)  # (rows × vocabulary pass 2^31 elements at ~14k rows)
        c = tl.program_id(1)
        t = tl.arange(0, TB)
        k = tl.arange(0, BLOCK_V)
        for j0 in range(c * PER, (c + 1) * PER, TB):
            blk = j0 + t
            col = blk[:, None] * BLOCK_V + k[None, :]
            ok = (col < V) & (blk[:, None] < NB)
            z = tl.load(X + b * sx + col, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
            m = tl.max(z, 1)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            s = tl.sum(tl.exp(z - m_safe[:, None]), 1)
            keep = (blk < NB) & (blk < (c + 1) * PER)
            tl.store(STATS + (b * NB + blk) * 2, m, mask=keep)
            tl.store(STATS + (b * NB + blk) * 2 + 1, s, mask=keep)

    @triton.jit
    def _search(X, STATS, U, TOK, LP, V, sx, inv_t, NB: tl.constexpr, TILE: tl.constexpr, BLOCK_V: tl.constexpr,
                EDGE: tl.constexpr):
        """Row b: the global max, the total mass, the block holding u · total, the token inside it."""
        b = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, TILE)
        top = tl.max(tl.full((TILE,), float("-inf"), tl.float32), 0)
        for j0 in range(0, NB, TILE):
            m = tl.load(STATS + (b * NB + j0 + i) * 2, mask=j0 + i < NB, other=float("-inf"))
            top = tl.maximum(top, tl.max(m, 0))
        total = top * 0.0  # the running sum's end, by the same operations as the search's running sums below
        for j0 in range(0, NB, TILE):
            ok = j0 + i < NB
            m = tl.load(STATS + (b * NB + j0 + i) * 2, mask=ok, other=float("-inf"))
            s = tl.load(STATS + (b * NB + j0 + i) * 2 + 1, mask=ok, other=0.0)
            total = tl.max(tl.where(ok, tl.cumsum(s * tl.exp(m - top), 0) + total, 0.0), 0)
        target = tl.minimum(tl.load(U + b) * total, total * EDGE)
        # the block: the number of blocks whose running mass is <= target (searchsorted, right)
        prefix = total * 0.0
        j = prefix.to(tl.int32)
        before = prefix
        for j0 in range(0, NB, TILE):
            ok = j0 + i < NB
            m = tl.load(STATS + (b * NB + j0 + i) * 2, mask=ok, other=float("-inf"))
            s = tl.load(STATS + (b * NB + j0 + i) * 2 + 1, mask=ok, other=0.0)
            mass = s * tl.exp(m - top)
            cdf = tl.cumsum(mass, 0) + prefix
            below = (cdf <= target) & ok
            j += tl.sum(below.to(tl.int32), 0)
            before = tl.maximum(before, tl.max(tl.where(below, cdf, 0.0), 0))
            prefix = tl.max(tl.where(ok, cdf, 0.0), 0)
        j = tl.minimum(j, NB - 1)
        k = tl.arange(0, BLOCK_V)
        col = j * BLOCK_V + k
        z = tl.load(X + b * sx + col, mask=col < V, other=float("-inf")).to(tl.float32) * inv_t
        inside = tl.cumsum(tl.exp(z - top), 0)
        r = tl.minimum(tl.maximum(target - before, 0.0), tl.max(inside, 0) * EDGE)
        tok = j * BLOCK_V + tl.sum((inside <= r).to(tl.int32), 0)
        z_tok = tl.load(X + b * sx + tok).to(tl.float32) * inv_t
        tl.store(TOK + b, tok.to(tl.int64))
        tl.store(LP + b, z_tok - top - tl.log(total))


def draw_triton(logits: Tensor, u: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """The Triton kernels (same arguments and result as ``draw_reference``)."""
    B, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    nb = math.ceil(V / BLOCK)
    TB = 8  # blocks per tile of the statistics pass
    chunks = max(1, min(math.ceil(nb / TB), 16))  # vocabulary chunks per row: rows × 16 programs for the pass
    per = math.ceil(math.ceil(nb / chunks) / TB) * TB
    stats = torch.empty(B, nb, 2, device=logits.device, dtype=torch.float32)
    tok = torch.empty(B, device=logits.device, dtype=torch.int64)
    lp = torch.empty(B, device=logits.device, dtype=torch.float32)
    inv_t = 1.0 / temperature
    _block_stats[(B, math.ceil(nb / per))](logits, stats, V, logits.stride(0), inv_t, NB=nb, PER=per, TB=TB,
                                           BLOCK_V=BLOCK)
    _search[(B,)](logits, stats, u.float().contiguous(), tok, lp, V, logits.stride(0), inv_t, NB=nb, TILE=1024,
                  BLOCK_V=BLOCK, EDGE=_EDGE)
    return tok, lp


def fused_draw(logits: Tensor, u: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """``draw_triton`` where the kernels run (CUDA with Triton, or Triton's interpreter), else ``draw_reference``."""
    run = draw_triton if kernel_available(logits.device) else draw_reference
    return run(logits, u, temperature)
