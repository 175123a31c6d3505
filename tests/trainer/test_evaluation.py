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


def test_evaluation_decodes_in_the_runs_precision(tmp_path, tiny_model_dir, tokenizer, tiny_model_factory,
                                                  monkeypatch):
    """Under bf16-mixed the rollouts decode in bfloat16 autocast; the evaluation must too (it runs in a callback,
    outside Lightning's autocast: in fp32 it took 60-106 s per evaluation on an H200 against ~3 s of rollout)."""
    import torch

    from gearlab.rollout.hf import HFRolloutEngine

    seen: list[tuple[bool, torch.dtype]] = []
    real = HFRolloutEngine.generate

    def spy(self, *a, **k):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return real(self, *a, **k)

    monkeypatch.setattr(HFRolloutEngine, "generate", spy)
    model = tiny_model_factory(0)
    for precision, expect in (("bf16-mixed", (True, torch.bfloat16)), ("32-true", None)):
        cfg = _cfg(tmp_path, tiny_model_dir, f"trainer.precision={precision}")
        seen.clear()
        evaluate_model(model, tokenizer, task_from_config(cfg), cfg)
        assert len(seen) == 2  # greedy, then sampled
        assert all(s == expect for s in seen) if expect else not any(on for on, _ in seen)
    assert not torch.is_autocast_enabled("cpu")


def test_one_engine_serves_every_evaluation_of_a_run(tmp_path, tiny_model_dir, monkeypatch):
    """The periodic evaluation keeps one rollout engine for the run (the fast decoder's compiled pieces and CUDA
    graphs are captured once, not at every evaluation)."""
    import gearlab.trainer.callbacks as callbacks
    import gearlab.trainer.evaluation as evaluation
    import gearlab.trainer.train as train_mod

    made: list[int] = []
    real = callbacks.engine_from_config
    monkeypatch.setattr(callbacks, "engine_from_config", lambda *a, **k: made.append(1) or real(*a, **k))
    monkeypatch.setattr(evaluation, "engine_from_config", lambda *a, **k: made.append(2) or real(*a, **k))
    calls: list[int] = []
    real_eval = evaluation.evaluate_model
    monkeypatch.setattr(evaluation, "evaluate_model", lambda *a, **k: calls.append(1) or real_eval(*a, **k))
    cfg = load_config([f"model.name_or_path={tiny_model_dir}", f"trainer.output_dir={tmp_path}", "eval.num_problems=4",
                       "eval.k=2", "rollout.max_new_tokens=6", "rollout.prompts_per_step=2", "rollout.group_size=2",
                       "trainer.max_steps=2", "trainer.eval_every=1", "trainer.progress_bar=false"])
    train_mod.train(cfg)
    assert len(calls) == 3  # before training, after iterations 1 and 2
    assert made == [1]  # one evaluation engine for the run (made by the callback), none per evaluation
