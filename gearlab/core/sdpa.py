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
The signal passes (``gearlab.signals.provider``: old, reference and teacher log-probs, entropy, divergences) leave it
out too, for reproducibility (below): cuDNN's decode-shape forward did not repeat on an H200, and nothing promises
that its prefill-shape forward does (8 repeats in one process did, ``experiments/gpu/signal_determinism_check.py``).

``reproducible_attention()`` leaves cuDNN out of the fast decoder's attention (``rollout.fast.attention=sdpa``, the
default off CUDA, and every prefill but ``sdpa_auto``'s).
A comparison pairs its runs by seed: children of one seed start from the same weights and draw the same
per-row uniforms, so their first rollout must be the same tokens. On an H200 (torch 2.11, cuDNN 9.19) it was not:
three children's first rollouts from one start had mean rewards 0.1878, 0.1897 and 0.1897 and their greedy
evaluations differed, and ``experiments/gpu/concurrent_decode_check.py`` gave a different token digest in every
process and in each process's second call (128 rows × 256 tokens; 64 rows × 64 tokens repeated exactly). Flash,
memory-efficient and math attention are run-to-run deterministic in the forward (PyTorch's reproducibility notes);
cuDNN's decode-shape forward was the cause: alone, on fixed inputs, it gave 2 different outputs in 20 runs on an
H200, and without it the check gives one digest for nine calls in three processes
(``experiments/results/smollm2_rg/decode_determinism_h200_sdpa.json``). On a CPU the flags are inert.
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


#: the same backends for forward passes that must give the same bits in every process (the fast decoder's rollouts:
#: see the module docstring); a second name because the reason differs
reproducible_attention = differentiable_attention
