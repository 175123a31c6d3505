"""Held-out evaluation: a fixed problem set (eval.seed) and the cached evaluation of the starting weights."""
from __future__ import annotations

from gearlab.config import load_config
from gearlab.tasks.registry import task_from_config
from gearlab.trainer.evaluation import cached_start_evaluation, eval_seed, evaluate_model, start_cache_key


def _cfg(tmp_path, model_dir, *extra):
    return load_config([f"model.name_or_path={model_dir}", f"trainer.output_dir={tmp_path}", "eval.num_problems=6",
                        "eval.k=2", "rollout.max_new_tokens=8", *extra])


def test_eval_seed_defaults_to_the_training_seed(tmp_path, tiny_model_dir):
    assert eval_seed(_cfg(tmp_path, tiny_model_dir, "trainer.seed=3")) == 3
    assert eval_seed(_cfg(tmp_path, tiny_model_dir, "trainer.seed=3", "eval.seed=0")) == 0


def test_start_evaluation_is_cached_exactly(tmp_path, tiny_model_dir, tokenizer, tiny_model_factory):
    model = tiny_model_factory(0)
    cfg = _cfg(tmp_path, tiny_model_dir, "eval.seed=0", "trainer.seed=1")
    task = task_from_config(cfg)
    first = cached_start_evaluation(model, tokenizer, task, cfg, tiny_model_dir)
    assert "cached" not in first
    # another training seed, same fixed held-out set: the same evaluation, read back
    other = _cfg(tmp_path, tiny_model_dir, "eval.seed=0", "trainer.seed=2")
    again = cached_start_evaluation(model, tokenizer, task, other, tiny_model_dir)
    assert again.pop("cached") is True
    assert {k: v for k, v in again.items() if k != "seconds"} == {k: v for k, v in first.items() if k != "seconds"}
    fresh = evaluate_model(model, tokenizer, task, other)
    assert {
        k: fresh[k] for k in ("greedy_accuracy", "avg@2", "pass@2")
    } == {k: first[k] for k in ("greedy_accuracy", "avg@2", "pass@2")}
    # anything that changes the evaluation changes the key
    key = start_cache_key(cfg, tiny_model_dir)
    assert start_cache_key(_cfg(tmp_path, tiny_model_dir, "eval.seed=1"), tiny_model_dir) != key
    assert start_cache_key(_cfg(tmp_path, tiny_model_dir, "eval.seed=0", "eval.num_problems=7"), tiny_model_dir) != key
    assert start_cache_key(
        _cfg(tmp_path, tiny_model_dir, "eval.seed=0", "rollout.max_new_tokens=9"), tiny_model_dir
    ) != key
    assert start_cache_key(cfg, tmp_path / "no-model") is None
    off = _cfg(tmp_path, tiny_model_dir, "eval.seed=0", "eval.cache_start=false")
    assert "cached" not in cached_start_evaluation(model, tokenizer, task, off, tiny_model_dir)


def test_greedy_off_drops_only_the_greedy_decode(tmp_path):
    """eval.greedy=false (the main job's setting): the sampled metrics keep their digits (each row has its own seed,
    so the greedy decode before them draws nothing from them), greedy accuracy is not reported."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gearlab.models.shipped import SHIPPED_DIR

    model = AutoModelForCausalLM.from_pretrained(SHIPPED_DIR)  # the warm start: some answers right, some wrong
    tok = AutoTokenizer.from_pretrained(SHIPPED_DIR)
    base = [f"model.name_or_path={SHIPPED_DIR}", f"trainer.output_dir={tmp_path}", "eval.num_problems=12", "eval.k=4",
            "eval.seed=0"]
    on, off = load_config(base), load_config([*base, "eval.greedy=false"])
    task = task_from_config(on)
    a, b = evaluate_model(model, tok, task, on), evaluate_model(model, tok, task, off)
    assert "greedy_accuracy" in a and "greedy_accuracy" not in b
    assert (b["avg@4"], b["pass@4"], b["problems"]) == (a["avg@4"], a["pass@4"], a["problems"]) and 0 < a["avg@4"] < 1
    assert start_cache_key(off, SHIPPED_DIR) != start_cache_key(on, SHIPPED_DIR)
