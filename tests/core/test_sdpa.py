"""gearlab.core.sdpa: the backward-safe SDPA backends."""
from __future__ import annotations

import torch

from gearlab.core.sdpa import differentiable_attention


def test_differentiable_attention_turns_only_cudnn_off_and_restores_the_flags():
    b = torch.backends.cuda
    before = (b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled())
    assert before == (True, True, True, True)
    with differentiable_attention():
        assert not b.cudnn_sdp_enabled()
        assert b.flash_sdp_enabled() and b.mem_efficient_sdp_enabled() and b.math_sdp_enabled()
    assert (b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled()) == before
