"""The attention kernels a forward pass that will be differentiated may use.

On NVIDIA Hopper cards (H100, H200) with torch >= 2.11, SDPA's default backend for a masked attention is cuDNN's,
and its backward returns NaN in the query gradient when all of these hold: an explicit ``attn_mask`` is passed (as
Hugging Face models do for any padded batch), the key length is 64 modulo 128, and some query row's log-sum-exp is
below ln(FLT_MAX) ≈ −88.7 — which every fully masked row is (a left-padding position attends to nothing: −inf).
The forward is correct; only the gradient is poisoned (pytorch/pytorch#196678; TRL's DPO hit it, huggingface/trl
#7181). gearlab met it as ~20% of GRPO steps skipped for a non-finite gradient once micro-batches were cropped to
their own widths (any length, so 1 in 128 micro-batches hit the bad remainder) on an H200 with torch 2.11.

``differentiable_attention()`` leaves cuDNN out for the passes that backpropagate (the update, the signals that take
input gradients): SDPA then picks flash (no mask) or memory-efficient attention, which are correct on those inputs.
Forward-only passes (rollouts, teacher passes) keep every backend: the bug is in the backward alone, and the fast
decoder's decode step is faster with cuDNN. On a CPU the flags are inert.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch.nn.attention import SDPBackend, sdpa_kernel

#: every SDPA backend but cuDNN's, in SDPA's own order of preference
BACKWARD_SAFE = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextmanager
def differentiable_attention() -> Iterator[None]:
    """SDPA without the cuDNN backend for the duration (the flags are restored on exit). The backend is chosen in
    the forward and the backward follows it, so wrapping the forward suffices."""
    with sdpa_kernel(BACKWARD_SAFE):
        yield
