"""Sums into bins that give the same bits in every run.

``Tensor.index_add_`` on CUDA adds with atomics, in an order that changes from run to run, so a float sum's last
bits do too (PyTorch's reproducibility notes list it among the nondeterministic CUDA operations). The per-group sums
of advantage computations (GRPO's group statistics, GEAR's mass normalisation) then differ in their last bit, the
update moves the weights differently, and a run rerun from the same start stops repeating after its first step.
These sums are over a batch's rows (hundreds to thousands of values), so on CUDA they are made on the CPU, which
adds in index order, and the result is moved back: two small copies and one synchronisation per call. Counts need
none of this (integers add exactly in any order: ``torch.bincount``).
"""
from __future__ import annotations

from torch import Tensor


def bin_sum(values: Tensor, index: Tensor, n: int) -> Tensor:
    """``out[k] = Σ_i values[i]`` over the ``i`` with ``index[i] == k``: [n] in ``values``' dtype and device.
    ``values`` [N] float, ``index`` [N] long in ``0..n-1``. Added in the order of ``i`` on every device (on the CPU,
    ``index_add_``'s own order; on CUDA the same, computed on the CPU); differentiable in ``values``."""
    if not values.is_cuda:
        return values.new_zeros(n).index_add_(0, index, values)
    host = values.cpu()
    return host.new_zeros(n).index_add_(0, index.cpu(), host).to(values.device)
