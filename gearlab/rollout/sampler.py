"""Per-row seeded sampling from logits, with no host synchronisation (so a CUDA graph can hold it).

Row ``b`` of a call draws its token at decode step ``t`` by inverse-CDF sampling with the uniform
``u = hash(seed_b, t)``: a counter-based generator, a pure function of integers computed with tensor ops, so
the same (seed, step) gives the same uniform on any device and in any batch. A row's samples therefore depend
only on its seed, its prompt and the weights — not on which other rows share the batch, the batch size or the
decode chunking — which is what keeps paired runs paired (each row gets ``seed + row``, as the vLLM engine does).

Conventions (the trainer's, docs/grpo.md): the sampled distribution is exactly softmax(logits / T), narrowed
by top-k / top-p only when those are set; the log-prob returned for a sampled token is log_softmax(logits / T)
at that token, over the FULL vocabulary (what the trainer's forward computes), also when top-k / top-p narrowed
the draw. Greedy decoding takes the argmax (lowest id on ties, as ``torch.argmax``).

The draw is inverse-CDF sampling done in two levels (``inverse_cdf``: find the block of 128 tokens, then the
token inside it), which picks the same token as one scan over the vocabulary except where float rounding of the
partial sums differs (a draw within ~1e-7 of an interval's edge).

Without top-k / top-p the draw takes one softmax kernel over the vocabulary and the reported log-prob is the log
of the drawn token's probability there (equal to log_softmax's to float32 rounding).

Simplifications: the uniform has 24 random bits (a float32's resolution, the same as the float32 CDF it is
compared with); the hash is the 32-bit "lowbias" integer mixer applied three times, not a cryptographic
generator — its uniformity is tested, not proven.
"""
from __future__ import annotations

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF
BLOCK = 128  # tokens per block of the two-level inverse CDF (inverse_cdf)


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash on int64 tensors holding values in [0, 2^32). The multipliers are < 2^31, so no
    product overflows int64 (overflow would be undefined behaviour in the kernels)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x46CA68B) & _M32
    return x ^ (x >> 16)


def row_uniforms(seeds: Tensor, step: Tensor) -> Tensor:
    """Uniforms in [0, 1) [B] float32, one per row, from per-row seeds [B] int64 (≥ 0) and the decode step
    (a 0-dim or [B] int64 tensor). Deterministic and device-independent."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    h = _mix32((step.to(torch.int64) * 0x9E3779B + 0x2545F491) & _M32)
    h = _mix32(h ^ hi)
    h = _mix32(h ^ lo)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def narrow(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """[B, V] tempered logits with the tokens outside top-k / the top-p nucleus set to -inf (no-op when off).
    top-p keeps the smallest set of most likely tokens whose mass reaches p (always the most likely one)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(-1) - probs  # mass of the strictly more likely tokens
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_rows(logits: Tensor, seeds: Tensor, step: Tensor, *, temperature: float, top_k: int = 0,
                top_p: float = 1.0, greedy: bool = False) -> tuple[Tensor, Tensor]:
    """Draw one token per row. logits [B, V] (any float dtype; computed in float32), seeds [B] int64, step: the
    draw number (0-dim int64, or [B] when rows continue responses from different points). Returns (tokens [B]
    int64, log-probs [B] float32 of those tokens under log_softmax(logits / T))."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    if greedy or top_k or top_p < 1.0:
        if greedy:
            tok = torch.argmax(logits, dim=-1)
        else:
            tok = inverse_cdf(torch.softmax(narrow(z, top_k, top_p), dim=-1), row_uniforms(seeds, step))
        # the FULL distribution's log-prob (as the trainer's), also where top-k / top-p narrowed the draw
        return tok, (z.gather(-1, tok[:, None]) - torch.logsumexp(z, dim=-1, keepdim=True)).squeeze(-1)
    # the common case in as few passes over [B, V] as the draw allows: one softmax kernel gives the draw's
    # distribution, and the token's log-prob is the log of its probability there (within float32 rounding of
    # log_softmax for any probability above float32's normal range, ~1e-38; a rarer token is never drawn: the
    # uniforms have 24 bits)
    probs = torch.softmax(z, dim=-1)
    tok = inverse_cdf(probs, row_uniforms(seeds, step))
    return tok, probs.gather(-1, tok[:, None]).log().squeeze(-1)


def inverse_cdf(probs: Tensor, u: Tensor, block: int = BLOCK) -> Tensor:
    """The token whose CDF interval holds ``u · total``: probs [B, V] float32 (≥ 0, any total > 0), u [B] in [0, 1)
    → token ids [B] int64, always a token of positive probability.

    Two levels, so no scan runs over the whole vocabulary (one over 128 × 151,936 took 0.26 ms of a 4.7 ms decode
    step on an H100): the vocabulary is cut into blocks of ``block`` tokens; a scan over the block totals finds the
    block, a scan inside that block finds the token. The target is clamped into the chosen block's own interval, so
    float rounding (the block totals and the in-block sums add in different orders) can move a draw at most to a
    neighbouring token of the same block, never onto a zero-probability token or off the end."""
    B, V = probs.shape
    nb = -(-V // block)
    # (a vocabulary that is a whole number of blocks, as Qwen's 151,936, is viewed in place: no copy per step)
    p = (probs if nb * block == V else torch.nn.functional.pad(probs, (0, nb * block - V))).view(B, nb, block)
    totals = p.sum(-1)  # [B, nb]
    cdf = totals.cumsum(-1)
    # strictly below the total (u < 1 already keeps it there in float32; the bound makes it independent of that)
    target = torch.minimum(u * cdf[:, -1], cdf[:, -1] * (1.0 - 2.0**-23))
    j = torch.searchsorted(cdf, target[:, None], right=True).clamp_(max=nb - 1)  # [B, 1] the block
    inside = p.gather(1, j[:, :, None].expand(B, 1, block)).squeeze(1).cumsum(-1)  # [B, block]
    before = cdf.gather(1, j) - totals.gather(1, j)  # [B, 1] mass of the blocks before j
    r = torch.minimum((target[:, None] - before).clamp_(min=0.0), inside[:, -1:] * (1.0 - 2.0**-23))
    k = torch.searchsorted(inside, r, right=True)  # < block: r < the block's total
    return (j * block + k).squeeze(-1)
