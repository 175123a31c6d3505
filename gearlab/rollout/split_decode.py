"""Split-K decode attention (flash-decoding) of the fast decoder: ``rollout.fast.attention=split``.

One decode step's attention reads each row's filled cache once: the keys of a (row, K/V head) are cut into
``splits`` contiguous chunks of whole 64-position blocks, one Triton program each, which keeps a running softmax
(max ``m``, sum ``l``, weighted values ``acc``, all float32) for every query head of the K/V head's group at once (the
group's queries are one [G, D] tile, so K and V are read once per K/V head, never expanded); a second kernel merges
the chunks of each (row, query head) in chunk order. No atomics and a fixed merge order: the same inputs give the
same bits on every run, in every process (a comparison's pairing needs that; SDPA's cuDNN path on Hopper does not
give it, ``gearlab.core.sdpa``).

Convention: q [B, H, 1, D], k and v [B, H_kv, L, D] (views of the cache: any strides with a unit last one),
``visible`` [B, L] bool (True = attend; each row sees at least one position, its current token), query head h uses
K/V head ``h // (H / H_kv)`` as Hugging Face's models do. The output is [B, H, 1, D] in k's dtype. Probabilities
are cast to the values' dtype before the P·V product, as flash attention's kernels do.

``split_count`` picks the chunks: enough programs to give each streaming multiprocessor two (``2 × SMs``), never a
chunk under one block. It depends only on the shapes and the card, so the grid is fixed per cache bucket (CUDA
graphs capture it) and every run of one shape does the same arithmetic.

Without CUDA or without Triton, ``SplitDecode`` runs ``split_decode_reference``: the same chunked algorithm in
PyTorch (the specification the kernel is tested against, and what the CPU runs). The kernel itself is tested on
the CPU through Triton's interpreter (``TRITON_INTERPRET=1``; ``tests/rollout/test_split_decode.py``).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from gearlab.rollout.kernels import kernel_available, triton

BLOCK_N = 64  # key positions per tile


def split_count(batch: int, kv_heads: int, length: int, sms: int) -> int:
    """Chunks per (row, K/V head): ``ceil(2·sms / (batch·kv_heads))``, at least 1, at most the 64-position blocks
    of ``length``."""
    blocks = math.ceil(length / BLOCK_N)
    return max(1, min(blocks, math.ceil(2 * sms / (batch * kv_heads))))


def _chunk(length: int, splits: int) -> int:
    """Positions per chunk: whole blocks, the last chunk possibly shorter (or empty)."""
    return math.ceil(math.ceil(length / splits) / BLOCK_N) * BLOCK_N


def split_decode_reference(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float, splits: int) -> Tensor:
    """The split-K algorithm in PyTorch: per chunk a float32 softmax over its visible keys, then the chunks merged
    by their maxima. q [B, H, 1, D], k, v [B, H_kv, L, D], visible [B, L] bool → [B, H, 1, D] in k's dtype."""
    B, H, _, D = q.shape
    H_kv, L = k.shape[1], k.shape[2]
    qg = q.reshape(B, H_kv, H // H_kv, D).float()
    step = _chunk(L, splits)
    ms, ls, accs = [], [], []
    for start in range(0, step * splits, step):
        kc, vc = k[:, :, start:start + step].float(), v[:, :, start:start + step]
        s = torch.einsum("bkgd,bknd->bkgn", qg, kc) * scale
        s = s.masked_fill(~visible[:, None, None, start:start + step], float("-inf"))
        m = s.amax(-1, keepdim=True) if s.shape[-1] else s.new_full((*s.shape[:-1], 1), float("-inf"))
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m_safe)
        ms.append(m)
        ls.append(p.sum(-1, keepdim=True))
        accs.append(torch.einsum("bkgn,bknd->bkgd", p.to(vc.dtype).float(), vc.float()))
    m = torch.cat(ms, -1)  # [B, H_kv, G, splits]
    top = m.amax(-1, keepdim=True)
    w = torch.exp(m - top)
    num = sum(a * w[..., i:i + 1] for i, a in enumerate(accs))
    den = (torch.cat(ls, -1) * w).sum(-1, keepdim=True)
    return (num / den).to(k.dtype).reshape(B, H, 1, D)


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _partial(Q, K, V, VIS, ACC, ML, scale, L, chunk, G,
                 sq_b, sq_h, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, svis_b,
                 H_KV: tl.constexpr, SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                 BLOCK: tl.constexpr, IEEE: tl.constexpr):
        """One (row, K/V head, chunk): running softmax of the group's G query heads over the chunk's keys."""
        bh = tl.program_id(0)
        s = tl.program_id(1)
        b = (bh // H_KV).to(tl.int64)  # (row offsets of a large cache pass 2^31 elements)
        hk = bh % H_KV
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        n0 = tl.arange(0, BLOCK)
        head = hk * G + g
        q = tl.load(Q + b * sq_b + head[:, None] * sq_h + d[None, :], mask=g[:, None] < G, other=0.0)
        m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        lsum = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, D), tl.float32)
        start = s * chunk
        end = tl.minimum(start + chunk, L)
        for n in range(start, end, BLOCK):
            pos = n + n0
            inside = pos < end
            k = tl.load(K + b * sk_b + hk * sk_h + pos[:, None] * sk_n + d[None, :], mask=inside[:, None], other=0.0)
            vis = tl.load(VIS + b * svis_b + pos, mask=inside, other=0) != 0
            if IEEE:  # float32 caches: full-precision products (tl.dot would take TF32 on the card)
                sc = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                sc = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            sc = tl.where((vis & inside)[None, :], sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            p = tl.exp(sc - m_safe[:, None])
            lsum = lsum * alpha + tl.sum(p, 1)
            vv = tl.load(V + b * sv_b + hk * sv_h + pos[:, None] * sv_n + d[None, :], mask=inside[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, vv, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv).to(tl.float32)
            m = m_new
        row = (b * H_KV * G + head) * SPLITS + s  # ACC [B, H, SPLITS, D], ML [B, H, SPLITS, 2] (int64: b is)
        tl.store(ACC + row[:, None] * D + d[None, :], acc, mask=g[:, None] < G)
        tl.store(ML + row * 2, m, mask=g < G)
        tl.store(ML + row * 2 + 1, lsum, mask=g < G)

    @triton.jit
    def _merge(ACC, ML, OUT, so_b, so_h, H: tl.constexpr, SPLITS: tl.constexpr, D: tl.constexpr):
        """One (row, query head): the chunks' partial softmaxes merged in chunk order."""
        bh = tl.program_id(0)
        b = (bh // H).to(tl.int64)
        h = bh % H
        d = tl.arange(0, D)
        first = bh.to(tl.int64) * SPLITS
        top = tl.load(ML + first * 2)
        for s in range(1, SPLITS):
            top = tl.maximum(top, tl.load(ML + (first + s) * 2))
        num = tl.zeros((D,), tl.float32)
        den = top * 0.0
        for s in range(SPLITS):
            w = tl.exp(tl.load(ML + (first + s) * 2) - top)  # 0 for an empty or wholly masked chunk
            den += w * tl.load(ML + (first + s) * 2 + 1)
            num += w * tl.load(ACC + (first + s) * D + d)
        tl.store(OUT + b * so_b + h * so_h + d, (num / den).to(OUT.dtype.element_ty))


def split_decode_triton(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float, splits: int) -> Tensor:
    """The Triton kernels (same arguments and result as ``split_decode_reference``)."""
    B, H, _, D = q.shape
    H_kv, L = k.shape[1], k.shape[2]
    G = H // H_kv
    if k.stride(-1) != 1 or v.stride(-1) != 1 or D & (D - 1) or D < 16:
        raise ValueError(f"split decode needs a unit last stride and a power-of-two head size >= 16 (got {D})")
    q = q.to(k.dtype)
    if q.stride(-1) != 1:
        q = q.contiguous()
    vis = visible.view(torch.uint8) if visible.dtype == torch.bool else visible
    acc = torch.empty(B, H, splits, D, device=q.device, dtype=torch.float32)
    ml = torch.empty(B, H, splits, 2, device=q.device, dtype=torch.float32)
    out = torch.empty(B, H, 1, D, device=q.device, dtype=k.dtype)
    _partial[(B * H_kv, splits)](
        q, k, v, vis, acc, ml, scale, L, _chunk(L, splits), G,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        vis.stride(0), H_KV=H_kv, SPLITS=splits, D=D, BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK=BLOCK_N,
        IEEE=k.dtype == torch.float32)
    _merge[(B * H,)](acc, ml, out, out.stride(0), out.stride(1), H=H, SPLITS=splits, D=D)
    return out


class SplitDecode:
    """A decode step's attention, split-K (see the module docstring): the Triton kernels where they run, the
    PyTorch reference elsewhere. ``sms``: the card's multiprocessor count, read once per device."""

    def __init__(self) -> None:
        self._sms: dict[torch.device, int] = {}

    def sms(self, device: torch.device) -> int:
        if device not in self._sms:
            self._sms[device] = (torch.cuda.get_device_properties(device).multi_processor_count
                                 if device.type == "cuda" else 1)
        return self._sms[device]

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> Tensor:
        """q [B, H, 1, D], k and v [B, H_kv, L, D], visible [B, L] bool → [B, H, 1, D] in k's dtype."""
        splits = split_count(q.shape[0], k.shape[1], k.shape[2], self.sms(k.device))
        run = split_decode_triton if kernel_available(k.device) else split_decode_reference
        with torch.autocast(k.device.type, enabled=False):
            return run(q, k, v, visible, scale, splits)
