"""Split-K decode attention (rollout.fast.attention=split): the PyTorch reference equals SDPA over grouped K/V heads,
masked and empty chunks included; the chunk count follows the stated rule; the Triton kernel, run by Triton's CPU
interpreter, equals the reference and repeats its bits; a decoder step and a whole greedy rollout with it give
SDPA's logits and tokens."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gearlab.rollout.split_decode import split_count, split_decode_reference

ROOT = Path(__file__).resolve().parents[2]
SHAPES = [  # B, H, H_kv, L (cache positions attended), splits
    (3, 16, 8, 320, 4),  # Qwen3-0.6B's grouping (2 query heads per K/V head); 320 = 5 blocks in chunks of 2: one empty
    (2, 9, 3, 130, 2),  # SmolLM2-135M's (3 per K/V head), a length off the block grid
    (4, 4, 4, 64, 1),  # no grouping, one block
    (2, 32, 8, 700, 5),  # Qwen3-4B/8B's (4 per K/V head), a long cache
]


def _inputs(B: int, H: int, H_kv: int, L: int, D: int, dtype: torch.dtype, seed: int = 0):
    """q, and k / v as views of a longer cache (strides of the real cache), with a visibility mask that hides left
    padding, the tail and all but one position of the last row."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, 1, D, generator=g).to(dtype)
    kc, vc = (torch.randn(B, H_kv, L + 50, D, generator=g).to(dtype) for _ in range(2))
    vis = torch.ones(B, L, dtype=torch.bool)
    vis[0, :40] = False
    vis[:, L - 20:] = False
    vis[-1, :L - 21] = False  # one visible key: every chunk but one wholly masked
    return q, kc[:, :, :L], vc[:, :, :L], vis


def _sdpa(q, k, v, vis, scale):
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=vis[:, None, None, :],
                                          scale=scale, enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("B,H,H_kv,L,splits", SHAPES)
def test_the_reference_equals_sdpa_with_masked_and_empty_chunks(B, H, H_kv, L, splits):
    """fp32 to 1e-6; bf16 (inputs and output, float32 softmax, bf16 probabilities in P·V) to bf16 rounding."""
    q, k, v, vis = _inputs(B, H, H_kv, L, 64, torch.float32)
    ref = _sdpa(q, k, v, vis, 0.125)
    for s in (1, splits):
        out = split_decode_reference(q, k, v, vis, 0.125, s)
        assert out.shape == (B, H, 1, 64) and out.dtype == torch.float32
        assert (out - ref).abs().max() < 1e-6, s
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out = split_decode_reference(qb, kb, vb, vis, 0.125, splits)
    assert out.dtype == torch.bfloat16
    assert (out.float() - _sdpa(qb, kb, vb, vis, 0.125)).abs().max() < 0.02


def test_the_chunk_count_fills_the_card_and_never_cuts_a_block():
    """2 programs per multiprocessor over (rows × K/V heads × chunks), at least one chunk, at most one per block."""
    assert split_count(128, 8, 320, 132) == 1  # the benchmark's batch fills an H100/H200 already
    assert split_count(16, 8, 2048, 132) == 3  # ceil(264 / 128)
    assert split_count(1, 8, 2048, 132) == 32  # 33 wanted, 32 blocks of 64
    assert split_count(1, 8, 100, 132) == 2  # two blocks
    assert split_count(4, 2, 64, 1) == 1


_KERNEL_CHECK = """
import json, sys, torch
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
from test_split_decode import SHAPES, _inputs
from gearlab.rollout.kernels import kernel_available
from gearlab.rollout.split_decode import split_decode_reference, split_decode_triton
assert kernel_available(torch.device("cpu"))
out = []
for dtype in (torch.float32, torch.float16):
    for B, H, H_kv, L, splits in SHAPES:
        q, k, v, vis = _inputs(B, H, H_kv, L, 32, dtype, seed=1)
        a = split_decode_triton(q, k, v, vis, 0.2, splits)
        b = split_decode_triton(q, k, v, vis, 0.2, splits)
        ref = split_decode_reference(q, k, v, vis, 0.2, splits)
        out.append(dict(dtype=str(dtype), shape=[B, H, H_kv, L, splits], out_dtype=str(a.dtype),
                        err=(a.float() - ref.float()).abs().max().item(), same_bits=torch.equal(a, b)))
print(json.dumps(out))
"""


@pytest.mark.triton
def test_the_triton_kernel_equals_the_reference_and_repeats_its_bits():
    """The kernels run by Triton's CPU interpreter (a fresh process: TRITON_INTERPRET is read at import) on every
    shape above, fp32 (to 1e-6) and fp16 (to fp16 rounding; the interpreter's bf16 matmul is not a float matmul),
    twice each: the same bits both times. On a card: experiments/gpu/concurrent_decode_check.py (mode split)."""
    pytest.importorskip("triton")
    code = _KERNEL_CHECK.format(root=str(ROOT), tests=str(Path(__file__).parent))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(rows) == 2 * len(SHAPES)
    for r in rows:
        assert r["same_bits"] and r["out_dtype"] == r["dtype"], r
        assert r["err"] < (1e-6 if r["dtype"] == "torch.float32" else 2e-3), r



@pytest.mark.parametrize("arch", ["qwen3", "llama_gqa", "llama_mha"])
def test_a_decoder_step_with_split_attention_gives_the_sdpa_steps_logits(tiny_model_factory, tokenizer, arch):
    """Decoder(attention="split"), one decode step over a 20-position bucket of a 24-position cache holding 12
    left-padded prompt positions, with 1e4 · N(0, 1) junk in every masked cache position (the padding, the bucket's
    unfilled tail, the cache past it): SDPA's logits to 2e-5 (fp32), the same keys and values written."""
    from gearlab.rollout.decoder import Decoder
    from tests.rollout.test_decoder import _llama, _llama_mha, _prompts, step_over_junk

    vocab = len(tokenizer)
    model = {"qwen3": lambda: tiny_model_factory(0).eval(), "llama_gqa": lambda: _llama(vocab),
             "llama_mha": lambda: _llama_mha(vocab)}[arch]()
    ids, mask = _prompts(vocab)
    sdpa, split = Decoder(model), Decoder(model, attention="split")
    assert split.split is not None and sdpa.split is None
    ours, ref = step_over_junk(sdpa, split, ids, mask)
    assert torch.allclose(ours, ref, atol=2e-5), (ours - ref).abs().max()


@pytest.mark.parametrize("shapes", ["off", "on"])
def test_a_greedy_rollout_with_split_attention_gives_hf_generates_tokens(tiny_model_factory, tokenizer, shapes):
    """rollout.fast.attention=split: a whole greedy rollout equals HF ``generate``'s tokens and the SDPA rollout's
    log-probs to 1e-5 (fp32), at exact lengths and at the CUDA-graph path's padded prompts and 8-token buckets."""
    from gearlab.rollout.base import SamplingParams
    from gearlab.rollout.fast import FastDecoder
    from gearlab.rollout.hf import HFRolloutEngine
    from gearlab.tasks.registry import get_task

    model = tiny_model_factory(0).eval()
    task = get_task("arith")
    eng = HFRolloutEngine(tokenizer, task, batch_size=8)
    ids, mask = eng.encode_prompts(task.problems("train", 7, seed=2))
    sp = SamplingParams(max_new_tokens=16, greedy=True)
    hf, hf_mask = eng.sample(model, ids, mask, sp, seed=0)
    ref = FastDecoder(tokenizer, batch_size=3, bucket=8, cuda_graphs=shapes).sample(model, ids, mask, sp, seed=0)
    split = FastDecoder(tokenizer, batch_size=3, bucket=8, cuda_graphs=shapes, attention="split")
    out = split.sample(model, ids, mask, sp, seed=0)
    assert split._decoder.attention == "split"
    assert torch.equal(out[0], hf) and torch.equal(out[1], hf_mask)
    assert (out[2] - ref[2])[ref[1]].abs().max() < 1e-5
