"""Accuracy as the warm start reports it: the shipped warm start's recorded accuracies re-measured alone."""
from __future__ import annotations

import json
import math

import pytest

from gearlab.models.accuracy import evaluate_accuracy
from gearlab.models.shipped import SHIPPED_DIR
from gearlab.tasks.registry import get_task


@pytest.fixture(scope="module")
def shipped():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(SHIPPED_DIR), AutoTokenizer.from_pretrained(SHIPPED_DIR)


def test_the_shipped_warm_starts_accuracies_are_re_measured_exactly(shipped):
    """warmstart.json's three accuracies (200 held-out arith problems, seed 0) come back digit for digit; the greedy
    one does not depend on how the prompts are batched (left padding), and the sampled one is seeded."""
    model, tok = shipped
    info = json.loads((SHIPPED_DIR / "warmstart.json").read_text())
    task = get_task("arith")
    test = task.problems("test", info["n_eval"], seed=info["seed"])
    kw = dict(max_new_tokens=48)
    assert evaluate_accuracy(model, tok, task, test, **kw) == info["acc_plain_greedy"] == 0.58
    assert evaluate_accuracy(model, tok, task, test, batch_size=7, **kw) == info["acc_plain_greedy"]
    assert evaluate_accuracy(model, tok, task, test, greedy=False, seed=0, **kw) == info["acc_plain_sampled"] == 0.475
    assert evaluate_accuracy(model, tok, task, test, privileged=True, **kw) == info["acc_privileged_greedy"] == 0.985


def test_evaluation_leaves_the_model_and_tokenizer_as_it_found_them(shipped):
    model, tok = shipped
    model.train()
    tok.padding_side = "right"
    try:
        task = get_task("arith")
        evaluate_accuracy(model, tok, task, task.problems("test", 4, seed=1), max_new_tokens=8)
        assert model.training and tok.padding_side == "right"
        assert math.isnan(evaluate_accuracy(model, tok, task, []))  # no problems: no accuracy, not 0
    finally:
        model.eval()
