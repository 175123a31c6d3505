"""Whether gearlab's Triton kernels (split-K decode attention, the one-pass draw) can run here.

Triton ships with CUDA builds of torch; CPU builds have none, and the kernels' PyTorch references run instead. With
``TRITON_INTERPRET=1`` (set before Triton is imported) Triton interprets the kernels on the CPU: how the tests check
them without a GPU.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def kernel_available(device: torch.device) -> bool:
    """Whether the Triton kernels run for tensors on ``device`` (CUDA with Triton, or Triton's interpreter)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
