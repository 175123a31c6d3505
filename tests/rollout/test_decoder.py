"""The static-cache decoder runs the HF model's own modules: its prefill logits equal the model's forward, for
the Qwen3 and Llama layouts, and it names what it cannot run."""
from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from gearlab.core.logprobs import position_ids_from_mask
from gearlab.rollout.decoder import Decoder, FusedWeights, KVCache, supports


def _llama(vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def _qwen2(vocab: int) -> Qwen2ForCausalLM:
    """Qwen2's layout: biases on q/k/v (none on o), grouped K/V heads."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises biases to 0: make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def _prompts(vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding of different lengths
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


def test_prefill_logits_equal_the_hf_forward(tiny_model_factory, tokenizer):
    for model in (tiny_model_factory(0).eval(), _llama(len(tokenizer))):
        assert supports(model) is None
        ids, mask = _prompts(len(tokenizer))
        dec = Decoder(model)
        with torch.no_grad():
            ours = dec.prefill(ids, mask, dec.new_cache(3, 16))
            ref = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits[:, -1]
        assert torch.allclose(ours, ref.float(), atol=2e-5), (ours - ref).abs().max()


@pytest.mark.parametrize("arch", ["qwen3", "llama_gqa"])
def test_one_decode_step_equals_the_forward_over_the_longer_sequence(tiny_model_factory, tokenizer, arch):
    """One position through the cache (for grouped K/V heads: the folded-heads attention) = the full forward."""
    model = tiny_model_factory(0).eval() if arch == "qwen3" else _llama(len(tokenizer))
    ids, mask = _prompts(len(tokenizer))
    nxt = torch.tensor([[7], [8], [9]])
    dec = Decoder(model)
    with torch.no_grad():
        cache = dec.new_cache(3, 16)
        dec.prefill(ids, mask, cache)
        pos = mask.sum(1, keepdim=True)
        L = 13
        visible = torch.cat([mask.bool(), torch.ones(3, 1, dtype=torch.bool)], 1)
        h = dec.forward(nxt, pos, cache, torch.tensor([12]), L, visible[:, None, None, :])
        x, m = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
        ref = model(input_ids=x, attention_mask=m, position_ids=position_ids_from_mask(m)).logits[:, -1]
    assert torch.allclose(dec.logits(h), ref, atol=2e-5)


@pytest.mark.parametrize("attention,cudnn", [("sdpa", False), ("sdpa_auto", True)])
def test_the_default_attention_runs_without_cudnn_in_prefill_and_decode(tokenizer, monkeypatch, attention, cudnn):
    """rollout.fast.attention=sdpa keeps cuDNN's attention out of every SDPA call of a rollout (on an H200 its decode
    gave different tokens in different processes); sdpa_auto leaves SDPA's choice alone. Both give the same logits
    (on a CPU the backend flags do not change the kernel)."""
    import gearlab.rollout.decoder as D

    seen, real = [], D.F.scaled_dot_product_attention

    def spy(q, *a, **k):
        seen.append((q.shape[2], torch.backends.cuda.cudnn_sdp_enabled()))
        return real(q, *a, **k)

    monkeypatch.setattr(D.F, "scaled_dot_product_attention", spy)
    model = _llama(len(tokenizer))
    ids, mask = _prompts(len(tokenizer))
    dec = Decoder(model, attention=attention)
    with torch.no_grad():
        cache = dec.new_cache(3, 16)
        dec.prefill(ids, mask, cache)
        visible = torch.cat([mask.bool(), torch.ones(3, 1, dtype=torch.bool)], 1)
        h = dec.forward(torch.tensor([[7], [8], [9]]), mask.sum(1, keepdim=True), cache, torch.tensor([12]), 13,
                        visible[:, None, None, :])
    assert {s for s, _ in seen} == {12, 2} and {c for _, c in seen} == {cudnn}  # prefill; decode: 4/2 heads folded
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored
    x, m = torch.cat([ids, torch.tensor([[7], [8], [9]])], 1), torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
    ref = model(input_ids=x, attention_mask=m, position_ids=position_ids_from_mask(m)).logits[:, -1]
    assert torch.allclose(dec.logits(h), ref, atol=2e-5)


def test_unsupported_models_are_named():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=64))
    reason = supports(gpt2)
    assert reason and "GPT2LMHeadModel" in reason
    try:
        Decoder(gpt2)
    except ValueError as e:
        assert str(e).startswith("rollout.engine=fast: GPT2LMHeadModel")
    else:
        raise AssertionError("Decoder accepted GPT-2")


def _step_logits(dec: Decoder, ids, mask) -> torch.Tensor:
    """Prefill logits and one decode step's logits, concatenated [3, 2·V]."""
    cache = dec.new_cache(3, 16)
    first = dec.prefill(ids, mask, cache)
    visible = torch.cat([mask.bool(), torch.ones(3, 1, dtype=torch.bool)], 1)
    h = dec.forward(first.argmax(-1, keepdim=True), mask.sum(1, keepdim=True), cache, torch.tensor([12]), 13,
                    visible[:, None, None, :])
    return torch.cat([first, dec.logits(h)], -1)


@pytest.mark.parametrize("arch", ["qwen3", "llama_gqa", "qwen2_bias"])
def test_fused_projections_give_the_unfused_logits_and_follow_in_place_updates(tiny_model_factory, tokenizer, arch):
    """q/k/v and gate/up as one GEMM each: the prefill and decode logits of the separate projections (fp32, to
    rounding); after an in-place weight update (an optimizer step) ``refresh_fused`` makes the copies follow, in the
    same buffers (captured graphs point at them)."""
    vocab = len(tokenizer)
    model = {"qwen3": lambda: tiny_model_factory(0).eval(), "llama_gqa": lambda: _llama(vocab),
             "qwen2_bias": lambda: _qwen2(vocab)}[arch]()
    ids, mask = _prompts(vocab)
    plain, fused = Decoder(model), Decoder(model, fused=True)
    with torch.no_grad():
        fused.refresh_fused()
        buffers = [t.data_ptr() for t in fused.fw.qkv + fused.fw.gate_up]
        assert torch.allclose(_step_logits(fused, ids, mask), _step_logits(plain, ids, mask), atol=2e-5)
        before = _step_logits(fused, ids, mask)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        now = _step_logits(plain, ids, mask)
        stale = _step_logits(fused, ids, mask)  # the copies are what it decodes: without a refresh, old projections
        assert not torch.allclose(stale, now, atol=1e-3)
        fused.refresh_fused()
        after = _step_logits(fused, ids, mask)
        assert torch.allclose(after, now, atol=2e-5)
        assert not torch.allclose(after, before, atol=1e-2)
    assert [t.data_ptr() for t in fused.fw.qkv + fused.fw.gate_up] == buffers
    has_bias = arch == "qwen2_bias"
    assert all((b is not None) == has_bias for b in fused.fw.qkv_bias) and all(b is None for b in fused.fw.gate_up_bias)
    layer = model.model.layers[0]
    assert fused.fw.sizes == (layer.self_attn.q_proj.out_features, layer.self_attn.k_proj.out_features,
                              layer.self_attn.v_proj.out_features)
    n = sum(m.weight.numel() + (m.bias.numel() if m.bias is not None else 0) for layer in model.model.layers
            for m in (*FusedWeights.groups(layer)[0], *FusedWeights.groups(layer)[1]))
    assert fused.fw.nbytes() == 4 * n  # fp32 here: the fused projections' parameters once more


def test_fused_copies_of_fp32_masters_are_in_the_autocast_dtype(tiny_model_factory, tokenizer):
    """Under bf16 autocast the copies are bf16 (no cast of fp32 master weights at every step) and decode what the
    unfused bf16-autocast path decodes, to bf16 rounding."""
    model = tiny_model_factory(0).eval()
    ids, mask = _prompts(len(tokenizer))
    plain, fused = Decoder(model), Decoder(model, fused=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        fused.refresh_fused()
        assert {t.dtype for t in fused.fw.qkv + fused.fw.gate_up} == {torch.bfloat16}
        ours, ref = _step_logits(fused, ids, mask), _step_logits(plain, ids, mask)
    assert (ours - ref).abs().max() < 0.1 * ref.abs().max() and (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.6


def _avx512() -> bool:
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    return any(isa.bit_width() == 512 for isa in valid_vec_isa_list())


def _inductor_at_avx512(on: bool):
    """Inductor's CPU code for AVX-512 (``cpp.simdlen``), whatever ATEN_CPU_CAPABILITY says; ATen's kernels keep it."""
    from contextlib import nullcontext

    from torch._inductor import config

    return config.patch({"cpp.simdlen": 512}) if on else nullcontext()


def _llama_mha(vocab: int) -> LlamaForCausalLM:
    """As many K/V heads as query heads: flex_attention without ``enable_gqa``."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("arch,compiled", [("qwen3", False), ("llama_gqa", True), ("qwen2_bias", False),
                                           ("llama_mha", False)])
def test_a_flex_decode_step_gives_the_sdpa_steps_logits_and_masked_positions_do_not_leak(
        tiny_model_factory, tokenizer, arch, compiled):
    """rollout.fast.attention=flex: one decode step over a 20-position bucket of a 24-position cache holding 12
    left-padded prompt positions (rows padded by 5, 0 and 1) gives the SDPA step's logits and writes the same keys
    and values (fp32 on the CPU, to 2e-5 as the other decoder tests), with large random values (1e4 · N(0, 1)) in
    every masked cache position: the left padding, the bucket's unfilled tail and the cache beyond it. Eager
    flex_attention (torch's reference implementation, the CPU's default), and once ``compiled``: Inductor's C++
    template (~7 s to compile), generated for AVX-512 (at AVX2, gearlab's CPU pin, torch 2.13's template fails:
    gearlab.rollout.attention), skipped on a CPU without it."""
    from gearlab.rollout.attention import FlexDecode

    if compiled and not _avx512():
        pytest.skip("compiled flex_attention on the CPU needs AVX-512 (torch 2.13's C++ template fails at AVX2)")
    vocab = len(tokenizer)
    model = {"qwen3": lambda: tiny_model_factory(0).eval(), "llama_gqa": lambda: _llama(vocab),
             "qwen2_bias": lambda: _qwen2(vocab), "llama_mha": lambda: _llama_mha(vocab)}[arch]()
    ids, mask = _prompts(vocab)
    sdpa, flex = Decoder(model), Decoder(model, attention="flex")
    flex.flex = FlexDecode(compiled=compiled)
    torch._dynamo.reset()  # (a graph compiled by another test, e.g. under autocast, is not this one's)
    with _inductor_at_avx512(compiled):
        ours, ref = step_over_junk(sdpa, flex, ids, mask)
    assert torch.allclose(ours, ref, atol=2e-5), (ours - ref).abs().max()
    assert set(flex.flex._masks) == {(20, torch.device("cpu"))}  # one block mask for the bucket, reused


def step_over_junk(sdpa: Decoder, dec: Decoder, ids: torch.Tensor, mask: torch.Tensor, L: int = 20, at: int = 12):
    """One decode step over an ``L``-position bucket of a 24-position cache holding ``at`` left-padded prompt
    positions: SDPA's logits on the clean cache and ``dec``'s on a copy with 1e4 · N(0, 1) in every masked position
    (the left padding, the bucket's unfilled tail, the cache past it). Asserts that SDPA ignores the junk too and
    that both write the same keys and values. Returns (dec's logits, SDPA's)."""
    visible = torch.cat([mask.bool(), torch.ones(3, L - at, dtype=torch.bool)], 1) & (torch.arange(L) <= at)
    nxt = torch.tensor([[7], [8], [9]])

    def step(d, cache):
        h = d.forward(nxt, mask.sum(1, keepdim=True), cache, torch.tensor([at]), L, visible[:, None, None, :])
        return d.logits(h)

    with torch.no_grad():
        clean = sdpa.new_cache(3, 24)
        sdpa.prefill(ids, mask, clean)
        dirty = KVCache([k.clone() for k in clean.keys], [v.clone() for v in clean.values])
        g = torch.Generator().manual_seed(3)
        hidden = ~torch.cat([mask.bool(), torch.ones(3, 24 - at, dtype=torch.bool)], 1)  # left padding
        hidden[:, at + 1:] = True  # the unfilled positions, in the bucket and past it
        for t in dirty.keys + dirty.values:
            junk = 1e4 * torch.randn(t.shape, generator=g)
            t.copy_(torch.where(hidden[:, None, :, None], junk, t))
        ref = step(sdpa, clean)
        ours = step(dec, dirty)
        assert torch.allclose(step(sdpa, dirty), ref, atol=2e-5)  # (the junk is masked for SDPA too)
        for a, b in zip(dirty.keys + dirty.values, clean.keys + clean.values):
            assert torch.allclose(a[:, :, at], b[:, :, at], atol=2e-5)
    return ours, ref
