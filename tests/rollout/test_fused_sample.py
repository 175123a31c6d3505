"""The one-pass draw (rollout.fast.sampler=fused): the PyTorch reference picks the two-level inverse CDF's token
for the same uniform and reports log_softmax at it, follows the tempered softmax (chi-square), never draws a token
of zero probability; the Triton kernels, run by Triton's CPU interpreter, equal the reference; a fast rollout with
it gives the torch sampler's tokens and the trainer's log-probs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gearlab.rollout.fused_sample import draw_reference
from gearlab.rollout.sampler import inverse_cdf, row_uniforms

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_the_reference_picks_the_inverse_cdfs_token_at_a_qwen_vocabulary(temperature):
    """16 rows × 151,936 logits (3 · N(0, 1)): the token of inverse_cdf(softmax(z)) for every row and the
    log-prob of log_softmax(z) at it to 5e-5 (|log p| up to ~20: float32 rounding of z and of the total)."""
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(16, 151_936, generator=g)
    u = row_uniforms(torch.arange(16) + 7, torch.tensor(5))
    tok, lp = draw_reference(logits, u, temperature)
    z = logits / temperature
    assert torch.equal(tok, inverse_cdf(torch.softmax(z, -1), u))
    ref = torch.log_softmax(z, -1).gather(1, tok[:, None]).squeeze(1)
    assert (lp - ref).abs().max() < 5e-5


def test_reference_draws_follow_the_tempered_softmax():
    """20,000 draws from 6 logits at T = 0.8: chi-square with 5 degrees of freedom below 20.5 (p = 0.001)."""
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5, -0.5]]).expand(20_000, 6)
    u = row_uniforms(torch.arange(20_000), torch.tensor(0))
    tok, _ = draw_reference(logits, u, 0.8)
    p = torch.softmax(logits[0] / 0.8, -1)
    counts = torch.bincount(tok, minlength=6).float()
    assert ((counts - 20_000 * p) ** 2 / (20_000 * p)).sum() < 20.5


def test_a_draw_never_lands_on_a_token_of_zero_probability():
    """Rows with only a few finite logits (the rest -inf, inside and across blocks, a vocabulary off the block
    grid), uniforms at 0 and just below 1: every token has a finite logit."""
    V = 1000
    logits = torch.full((4, V), float("-inf"))
    logits[0, 3] = 0.0
    logits[1, [0, 999]] = torch.tensor([1.0, 1.0])
    logits[2, 128:256] = torch.linspace(-5, 5, 128)
    logits[3, [127, 128, 640]] = torch.tensor([-50.0, 0.0, 0.0])
    for u0 in (0.0, 1.0 - 2.0**-24, 0.5):
        tok, lp = draw_reference(logits, torch.full((4,), u0), 1.0)
        assert torch.isfinite(logits.gather(1, tok[:, None])).all(), (u0, tok)
        assert torch.isfinite(lp).all() and (lp <= 0).all()
    assert draw_reference(logits, torch.zeros(4), 1.0)[0][0] == 3


_KERNEL_CHECK = """
import json, sys, torch
sys.path.insert(0, {root!r})
from gearlab.rollout.fused_sample import draw_reference, draw_triton
from gearlab.rollout.kernels import kernel_available
from gearlab.rollout.sampler import row_uniforms
assert kernel_available(torch.device("cpu"))
g = torch.Generator().manual_seed(1)
out = []
for B, V, T, dtype in ((3, 151936, 0.7, torch.float32), (5, 1000, 1.0, torch.float32), (4, 300, 1.3, torch.float16)):
    logits = (3 * torch.randn(B, V, generator=g)).to(dtype)
    logits[0, 5:] = float("-inf")  # one row with five tokens
    u = row_uniforms(torch.arange(B), torch.tensor(2))
    t1, l1 = draw_triton(logits, u, T)
    t2, l2 = draw_triton(logits, u, T)
    tr, lr = draw_reference(logits, u, T)
    out.append(dict(shape=[B, V], same_tokens=torch.equal(t1, tr), lp_err=(l1 - lr).abs().max().item(),
                    same_bits=torch.equal(t1, t2) and torch.equal(l1, l2), row0_token=int(t1[0])))
print(json.dumps(out))
"""


@pytest.mark.triton
def test_the_triton_kernels_equal_the_reference_and_repeat_their_bits():
    """Through Triton's CPU interpreter (a fresh process: TRITON_INTERPRET is read at import): Qwen's vocabulary,
    a vocabulary off the block grid, fp16 logits; the reference's tokens, log-probs to 1e-5, the same bits twice."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", _KERNEL_CHECK.format(root=str(ROOT))], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(rows) == 3
    for r in rows:
        assert r["same_tokens"] and r["same_bits"] and r["lp_err"] < 1e-5 and r["row0_token"] < 5, r


@pytest.mark.parametrize("temperature,bf16", [(1.0, False), (0.8, False), (1.0, True)])
def test_a_fast_rollout_with_the_fused_draw_gives_the_torch_samplers_tokens(tiny_model_factory, tokenizer,
                                                                            temperature, bf16):
    """rollout.fast.sampler=fused: 7 prompts × 16 sampled tokens (CUDA-graph shapes) equal the torch sampler's,
    their log-probs within 1e-5 — in fp32, and under bf16 autocast, where the draw reads the head's bf16 logits
    (no float32 copy) and the torch sampler their float32 copy."""
    from contextlib import nullcontext

    from gearlab.rollout.base import SamplingParams
    from gearlab.rollout.fast import FastDecoder
    from gearlab.rollout.hf import HFRolloutEngine
    from gearlab.tasks.registry import get_task

    model = tiny_model_factory(0).eval()
    task = get_task("arith")
    ids, mask = HFRolloutEngine(tokenizer, task, batch_size=8).encode_prompts(task.problems("train", 7, seed=2))
    sp = SamplingParams(max_new_tokens=16, temperature=temperature)
    with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext():
        ref = FastDecoder(tokenizer, batch_size=4, bucket=8, cuda_graphs="on").sample(model, ids, mask, sp, seed=11)
        out = FastDecoder(tokenizer, batch_size=4, bucket=8, cuda_graphs="on", sampler="fused").sample(
            model, ids, mask, sp, seed=11)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert (out[2] - ref[2])[ref[1]].abs().max() < 1e-5
    with pytest.raises(ValueError, match="rollout.fast.sampler"):
        FastDecoder(tokenizer, sampler="numpy")
