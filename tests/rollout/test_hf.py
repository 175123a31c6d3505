"""The HF rollout engine's static-KV-cache option: the same samples as the default dynamic cache (the
extra left padding is masked), on the tiny model. (The GPU speed-up — transformers compiling the decode
step for a static cache — is measured in experiments/bench/trl_vs_gearlab.py, not here.)"""
from __future__ import annotations

import torch

from gearlab.rollout.hf import HFRolloutEngine
from gearlab.rollout.base import SamplingParams, pad_left_to
from gearlab.tasks.registry import get_task


def test_pad_left_to_a_multiple():
    ids, mask = torch.tensor([[0, 5, 6]]), torch.tensor([[0, 1, 1]])
    p_ids, p_mask = pad_left_to(ids, mask, 4, pad_id=0)
    assert p_ids.tolist() == [[0, 0, 5, 6]] and p_mask.tolist() == [[0, 0, 1, 1]]
    assert pad_left_to(p_ids, p_mask, 4, 0)[0] is p_ids


def test_static_cache_samples_equal_dynamic(tokenizer):
    from gearlab.models.tiny import build_tiny_model

    model = build_tiny_model(tokenizer, seed=0)
    task = get_task("arith")
    eng = HFRolloutEngine(tokenizer, task, batch_size=8)
    static = HFRolloutEngine(tokenizer, task, batch_size=8, static_cache=True)
    ids, mask = eng.encode_prompts(task.problems("train", 6, seed=2))
    assert ids.shape[1] % 64  # the static engine really pads
    for sp in (SamplingParams(max_new_tokens=20, greedy=True), SamplingParams(max_new_tokens=20)):
        r1, m1 = eng.sample(model, ids, mask, sp, seed=3)
        r2, m2 = static.sample(model, ids, mask, sp, seed=3)
        assert torch.equal(m1, m2) and torch.equal(r1 * m1, r2 * m2)
