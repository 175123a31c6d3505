"""Decode-step attention of the fast decoder with FlexAttention (``rollout.fast.attention=flex``).

``Decoder`` runs a decode step's attention (one new position per row) over the first ``length`` positions of the
KV cache. With ``attention="sdpa"`` (the default off CUDA) that is ``F.scaled_dot_product_attention``; on GPUs
SDPA has no decode kernel: at long caches (1–4k positions) it does not split the keys across thread blocks, so a
small batch leaves most of the card idle. ``FlexDecode`` runs the same attention through
``torch.nn.attention.flex_attention.flex_attention``, compiled: on CUDA, Inductor lowers a call whose query is
shorter than 128 positions to its split-K "flex decoding" Triton kernel (``torch/_inductor/kernel/flex/
flex_decoding.py``: the keys are cut into ``SPLIT_KV`` tiles, one thread block each, and the partial softmaxes are
merged), on the CPU to a C++ template. Prefill stays SDPA.

How the mask is given (``_flex_step``): the step's boolean mask [B, length] (the key is a prompt token or a
generated one, and at most the current position) is read by a ``score_mod`` that sets a masked score to -inf. The
mask is a graph input of the compiled function, a new tensor each step with no new compile, so nothing is built per
step and the step stays capturable in a CUDA graph (no host sync; fixed shapes per bucket). A ``mask_mod`` instead
would need a ``BlockMask`` made from that tensor at every step (``create_block_mask``: a dozen small kernels and
Python work per call), to skip only key blocks of 128 positions masked whole — at decode, little (left padding).
The block mask here is only the layout: every KV block of 128 positions listed (``create_block_mask(noop_mask,
…)``), made once per (length, device) and reused. It is not optional on CUDA: without one, flex_attention takes a
single block of 2^30 positions, and the decode kernel's tile per split, ``cdiv(blocks × block size, SPLIT_KV)``,
then covers the whole cache: one thread block does all the work.

When the decode kernel is used (``_use_flex_decoding`` in torch 2.13): a query length < 128, a static batch size
and head count, and with grouped K/V heads (``enable_gqa``) a power-of-two number of query heads per K/V head
(Qwen3 0.6B: 16/8; SmolLM2-135M's 9/3 falls back to the general flex kernel, still correct). Inductor picks
``SPLIT_KV = 2 × SMs // (B × H_kv)``, at least 1: at batch 128 × 8 K/V heads there is one split, so the kernel
matters at small batches or few K/V heads.

Compilation: one ``torch.compile`` of ``_flex_step`` (``fullgraph``, ``dynamic=True``), shared by every decoder,
with the batch dimension marked static (the decode kernel needs it) and the scale specialised (a constant, not a
tensor input): each batch size compiles once for caches of one 128-position block and once for longer ones (Dynamo
specialises a size of 1: the block mask's block count), and no bucket or step length compiles anew (seen on the
CPU; on CUDA not yet run).

On the CPU the call runs eagerly by default (``FlexDecode(compiled=None)``: compiled on CUDA only): torch's
reference implementation (it materialises the scores), for CPU tests; the CPU's speed is not what this path is for.
Compiled, torch 2.13's C++ flex template fails here: at AVX2 — gearlab's CPU pin (``ATEN_CPU_CAPABILITY=avx2``,
``gearlab.cpu_kernels``) and every AVX2-only CPU — its vectorised read of the captured mask stops with "index out
of bounds" at every cache length tried (17–300); at AVX-512 the first graph of a batch size is right (tested, with
Inductor set to AVX-512), but a second one (``dynamic=None``'s length-dynamic recompile, or a second block count)
fails to compile (``cur_qSplitSize5`` undeclared in the generated C++).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention, noop_mask

from gearlab.parallel.compiling import deterministic_compile, raise_recompile_limit

ATTENTION = ("sdpa", "sdpa_auto", "flex", "split")  # the decoder's kernels; rollout.fast.attention also takes auto
_COMPILED: list[Callable[..., Tensor]] = []  # torch.compile(_flex_step), made at the first use


def _flex_step(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, block_mask: BlockMask, scale: float) -> Tensor:
    """Attention of q [B, H, 1, D] over k, v [B, H_kv, L, D] where ``visible`` [B, L] (bool) is True."""

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return torch.where(visible[b, kv_idx], score, float("-inf"))

    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                          enable_gqa=q.shape[1] != k.shape[1])


def _compiled_step() -> Callable[..., Tensor]:
    if not _COMPILED:
        raise_recompile_limit()  # (two graphs per batch size: over Dynamo's default of 8 at 5 batch sizes)
        compiled = deterministic_compile(_flex_step, fullgraph=True, dynamic=True)
        # the scale stays a constant of the kernel: under dynamic=True Dynamo would make a float argument a tensor input
        _COMPILED.append(torch._dynamo.config.patch(specialize_float=True)(compiled))
    return _COMPILED[0]


class FlexDecode:
    """A decode step's attention with ``flex_attention`` (see the module docstring). ``compiled``: None = on CUDA
    (the CPU runs torch's eager reference, which materialises the scores), True / False = always / never."""

    def __init__(self, compiled: bool | None = None) -> None:
        self.compiled = compiled
        self._masks: dict[tuple[int, torch.device], BlockMask] = {}

    def block_mask(self, length: int, device: torch.device) -> BlockMask:
        """Every KV block of [0, length) for one query position, made once per (length, device)."""
        key = (length, device)
        if key not in self._masks:
            self._masks[key] = create_block_mask(noop_mask, None, None, 1, length, device=device)
        return self._masks[key]

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> Tensor:
        """q [B, H, 1, D], k and v [B, H_kv, L, D] (views of the cache), visible [B, L] bool → [B, H, 1, D] in the
        cache's dtype (q is cast to it, as SDPA under autocast computes in one dtype)."""
        q = q.to(k.dtype)
        fn = _flex_step
        if self.compiled or (self.compiled is None and k.is_cuda):
            fn = _compiled_step()
            for t in (q, k, v, visible):
                torch._dynamo.mark_static(t, 0)  # the batch: the decode kernel's split count needs it static
        with torch.autocast(k.device.type, enabled=False):  # q, k, v share the dtype already
            return fn(q, k, v, visible, self.block_mask(k.shape[2], k.device), scale)
