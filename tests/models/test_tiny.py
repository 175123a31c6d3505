"""Tiny offline model + tokenizer, and a mini warm start."""
from __future__ import annotations

import json
import os

import torch

from gearlab.models.tiny import build_tiny_model, build_tokenizer, make_tiny
from gearlab.tasks.arithmetic import ArithmeticTask

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMALL = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)


def test_tokenizer_deterministic_and_round_trips():
    a, b = build_tokenizer(), build_tokenizer()
    assert a.get_vocab() == b.get_vocab()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert len(a) <= 512
    for text in ["Compute 12 + 345 * 6 left to right.", "12*3=36\nAnswer: -36", "héllo wörld ✓ \t\n  x", ""]:
        assert a.decode(a.encode(text, add_special_tokens=False)) == text
    # digits are one token each
    ids = a.encode("12345", add_special_tokens=False)
    assert [a.decode([i]) for i in ids] == list("12345")
    assert a.pad_token == "<|endoftext|>" and a.eos_token == "<|im_end|>"
    assert a.convert_tokens_to_ids("<|im_start|>") != a.unk_token_id


def test_chat_template():
    tok = build_tokenizer()
    task = ArithmeticTask()
    p = task.make_problem([7, 5, 3], ["+", "*"])
    text = tok.apply_chat_template(task.messages(p), add_generation_prompt=True, tokenize=False)
    assert text == f"<|im_start|>user\n{p.prompt}<|im_end|>\n<|im_start|>assistant\n"
    full = tok.apply_chat_template(
        task.messages(p) + [{"role": "assistant", "content": p.solution}], tokenize=False
    )
    assert full.startswith(text) and full.endswith(p.solution + "<|im_end|>\n")
    assert tok.decode(tok.encode(full, add_special_tokens=False)) == full
    # the special tokens are single tokens
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_make_tiny_save_load_offline(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = make_tiny(tmp_path / "tiny", seed=0, **SMALL)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "qwen3" and model.config.tie_word_embeddings
    assert model.config.pad_token_id == tok.pad_token_id
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.vocab_size == len(tok)
    ref = build_tiny_model(build_tokenizer(), seed=0, **SMALL)
    for (k, v), (k2, v2) in zip(sorted(model.state_dict().items()), sorted(ref.state_dict().items())):
        assert k == k2 and torch.equal(v, v2), k
    text = tok.apply_chat_template([{"role": "user", "content": "Compute 1 + 2 left to right."}],
                                   add_generation_prompt=True, tokenize=False)
    enc = tok(text, return_tensors="pt", add_special_tokens=False)
    gen = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape[1] <= enc["input_ids"].shape[1] + 4


def test_default_model_size():
    model = build_tiny_model(build_tokenizer())
    n = sum(p.numel() for p in model.parameters())
    assert 0.5e6 < n < 5e6


def test_named_model_sizes():
    from gearlab.models.tiny import MODEL_SIZES

    assert MODEL_SIZES["tiny"] == {}
    n = sum(p.numel() for p in build_tiny_model(build_tokenizer(), **MODEL_SIZES["small"]).parameters())
    assert n == 25_338_880  # the figure docs and the arith_long_gpu preset quote


def test_sft_masks_prompt_tokens():
    from gearlab.models.warmstart import collate_sft, encode_sft_example

    tok = build_tokenizer()
    task = ArithmeticTask()
    p = task.make_problem([7, 5, 3], ["+", "*"])
    ex_plain = encode_sft_example(tok, task, p, privileged=False)
    ex_priv = encode_sft_example(tok, task, p, privileged=True)
    batch = collate_sft([ex_plain, ex_priv], tok.pad_token_id)
    for row, (ids, n_prompt) in enumerate([ex_plain, ex_priv]):
        labelled = batch["labels"][row][batch["labels"][row] != -100].tolist()
        assert labelled == ids[n_prompt:]
        assert tok.decode(labelled) == p.solution + "<|im_end|>"
    assert ex_priv[1] > ex_plain[1]  # privileged prompt is longer (it holds the answer)


def test_mini_warmstart_lowers_loss(tmp_path):
    from gearlab.models.warmstart import warmstart

    model_dir = make_tiny(tmp_path / "init", seed=0, **SMALL)
    res = warmstart(
        tmp_path / "ws", task="arith", model_dir=model_dir, steps=20, batch_size=8, lr=1e-2,
        seed=0, log_every=0, warmup_steps=2, n_eval=4, eval_max_new_tokens=8, verbose=False,
    )
    assert res["steps"] == 20
    assert res["loss_last"] < 0.8 * res["loss_first"]
    for key in ("acc_plain_greedy", "acc_plain_sampled", "acc_privileged_greedy"):
        assert 0.0 <= res[key] <= 1.0
    saved = json.loads((tmp_path / "ws" / "warmstart.json").read_text())
    assert saved["steps"] == 20 and saved["loss_last"] == res["loss_last"] and saved["device"] == "cpu"
    assert (tmp_path / "ws" / "config.json").exists() and (tmp_path / "ws" / "tokenizer.json").exists()
