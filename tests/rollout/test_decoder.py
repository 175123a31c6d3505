"""The static-cache decoder runs the HF model's own modules: its prefill logits equal the model's forward, for
the Qwen3 and Llama layouts, and it names what it cannot run."""
from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from gearlab.core.logprobs import position_ids_from_mask
from gearlab.rollout.decoder import Decoder, supports


def _llama(vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


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
