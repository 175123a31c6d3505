"""rollout.engine=auto: the fast decoder on CUDA for a layout it runs (one GPU, DDP, FSDP1, FSDP2), HF generate
everywhere else; rollout.fast.attention=auto: the split-K Triton kernel on CUDA with Triton, SDPA everywhere else; a
training run records what they resolved to."""
from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from gearlab.config import ConfigError, load_config
from gearlab.rollout import fast
from gearlab.rollout.factory import engine_from_config, resolve_engine
from gearlab.rollout.fast import FastDecoder, resolve_attention
from gearlab.tasks.registry import get_task


@pytest.mark.parametrize("overrides, cuda, supported, expected", [
    ([], True, True, "fast"),
    ([], False, True, "hf"),  # no GPU: HF generate, as before the fast path existed
    (["trainer.accelerator=cpu"], True, True, "hf"),
    ([], True, False, "hf"),  # a layout the decoder does not run
    (["trainer.devices=2", "trainer.strategy=fsdp2"], True, True, "fast"),  # sharded: gathered for each rollout
    (["trainer.devices=2", "trainer.strategy=fsdp1"], True, True, "fast"),
    (["trainer.devices=2", "trainer.strategy=fsdp2"], True, False, "hf"),
    (["trainer.devices=2", "trainer.strategy=ddp"], True, True, "fast"),
    (["rollout.engine=hf"], True, True, "hf"),  # an explicit choice stays
    (["rollout.engine=fast"], False, True, "fast"),
])
def test_auto_picks_the_fast_decoder_for_a_cuda_policy_it_runs(
        monkeypatch, tiny_model_factory, overrides, cuda, supported, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    cfg = load_config(overrides)
    model = tiny_model_factory(0) if supported else GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)
    )
    assert resolve_engine(cfg, model) == expected


def test_the_engine_built_for_auto_and_the_corrections_that_need_an_explicit_engine(
    monkeypatch, tokenizer, tiny_model_factory
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = load_config([])
    assert cfg.rollout.engine == "auto"
    engine = engine_from_config(tokenizer, get_task("arith"), cfg, model=tiny_model_factory(0))
    assert isinstance(engine.generator, FastDecoder) and engine.generator.compile is None  # None: compile on CUDA
    assert engine_from_config(tokenizer, get_task("arith"), cfg).generator is None  # no policy given: HF generate
    # an importance correction needs the engine's log-probs, which HF generate does not give: auto is not enough
    with pytest.raises(ConfigError, match="key 'algorithm.engine_is': .*set rollout.engine=vllm or fast"):
        load_config(["algorithm.engine_is=token_truncate"])


def _claim(monkeypatch, cuda: bool, kernel: bool) -> list[torch.device]:
    """CUDA and gearlab's Triton kernels as claimed; returns the devices kernel_available was asked about."""
    asked: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(fast, "kernel_available", lambda device: asked.append(device) or kernel)
    return asked


@pytest.mark.parametrize("overrides, cuda, kernel, expected", [
    ([], True, True, "split"),
    ([], False, True, "sdpa"),  # Triton's CPU interpreter makes the kernel available, not a CUDA policy
    ([], True, False, "sdpa"),  # a torch without Triton
    (["trainer.accelerator=cpu"], True, True, "sdpa"),
    (["rollout.fast.attention=flex"], True, True, "flex"),  # an explicit choice stays
    (["rollout.fast.attention=sdpa"], True, True, "sdpa"),
    (["rollout.fast.attention=sdpa_auto"], False, False, "sdpa_auto"),
    (["rollout.fast.attention=split"], False, False, "split"),
])
def test_auto_attention_is_the_split_kernel_on_cuda_with_triton(monkeypatch, overrides, cuda, kernel, expected):
    asked = _claim(monkeypatch, cuda, kernel)
    assert resolve_attention(load_config(overrides)) == expected
    assert all(d.type == "cuda" for d in asked)


def test_the_fast_decoder_of_every_command_gets_the_resolved_kernel(monkeypatch, tokenizer, tiny_model_factory):
    """engine_from_config (evaluation, inspect, replay, credit-eval and training) never hands the decoder auto."""
    cfg = load_config(["rollout.engine=fast"])
    assert cfg.rollout.fast.attention == "auto"
    _claim(monkeypatch, cuda=True, kernel=True)
    assert engine_from_config(tokenizer, get_task("arith"), cfg).generator.attention == "split"
    _claim(monkeypatch, cuda=False, kernel=False)
    assert engine_from_config(tokenizer, get_task("arith"), cfg).generator.attention == "sdpa"
    assert cfg.rollout.fast.attention == "auto"  # the caller's config is left as it was
