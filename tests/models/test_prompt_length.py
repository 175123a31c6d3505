"""The load-time prompt-length check counts exactly what the rollout engine feeds the model, and its byte-only refusal
of huge prompts never claims more tokens than there are."""
from __future__ import annotations

import copy
import json
import re
from types import SimpleNamespace

import pytest

from gearlab.config import ConfigError, load_config
from gearlab.models.prompt_length import check_prompt_lengths, context_length, prompt_limit
from gearlab.rollout.hf import HFRolloutEngine
from gearlab.tasks.registry import get_task

ROWS = [{"prompt": "What is 12+30?", "answer": "42"},
        {"prompt": "x " * 40 + "y", "answer": "1"},
        {"prompt": "café € 😀 naïve " * 7, "answer": "2"},  # multi-byte characters: bytes and tokens differ
        {"prompt": "1 + 2 = 3. " * 30, "answer": "3"}]


def _task(tmp_path, rows=ROWS):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data, get_task("jsonl", train_path=str(data))


def _engine_lengths(tokenizer, task) -> list[int]:
    _, mask = HFRolloutEngine(tokenizer, task).encode_prompts([p for _, p in task.sourced_problems()])
    return mask.sum(1).tolist()


@pytest.mark.parametrize("template", [True, False], ids=["chat_template", "no_template"])
def test_the_limit_is_exact_in_the_engines_tokens(tmp_path, tokenizer, template):
    tok = tokenizer if template else copy.deepcopy(tokenizer)
    if not template:
        tok.chat_template = None  # the engine then joins the messages with newlines
    data, task = _task(tmp_path)
    lengths = _engine_lengths(tok, task)
    longest = max(lengths)
    row = lengths.index(longest) + 1
    no_context = SimpleNamespace()
    check_prompt_lengths(load_config([f"task.max_prompt_tokens={longest}"]), task, tok, no_context)  # fits exactly
    msg = (f"{data}:{row}: prompt is {longest} tokens after the chat template, over the limit of {longest - 1} tokens "
           f"(task.max_prompt_tokens)")
    with pytest.raises(ConfigError, match=re.escape(msg) + "$"):
        check_prompt_lengths(load_config([f"task.max_prompt_tokens={longest - 1}"]), task, tok, no_context)


def test_the_context_leaves_room_for_the_response(tmp_path, tokenizer):
    data, task = _task(tmp_path)
    lengths = _engine_lengths(tokenizer, task)
    cfg = load_config(["rollout.max_new_tokens=40"])
    model = SimpleNamespace(max_position_embeddings=max(lengths) + 40)
    check_prompt_lengths(cfg, task, tokenizer, model)
    model.max_position_embeddings -= 1
    with pytest.raises(ConfigError, match=re.escape(f"(the model's context {max(lengths) + 39} minus "
                                                    "rollout.max_new_tokens 40)")):
        check_prompt_lengths(cfg, task, tokenizer, model)
    with pytest.raises(ConfigError, match="key 'rollout.max_new_tokens': .* leaves no room for a prompt"):
        prompt_limit(load_config(["rollout.max_new_tokens=512"]), task, 512)


def test_the_byte_refusal_is_a_true_lower_bound(tmp_path, tokenizer):
    data, task = _task(tmp_path, [{"prompt": "1+1?", "answer": "2"}, {"prompt": "9 + 9 = 18. " * 2000, "answer": "18"}])
    with pytest.raises(ConfigError) as e:
        check_prompt_lengths(load_config(["task.max_prompt_tokens=20"]), task, tokenizer, SimpleNamespace())
    m = re.fullmatch(rf"{re.escape(str(data))}:2: prompt is 24,000 bytes, so at least ([\d,]+) tokens, over the limit "
                     r"of 20 tokens \(task.max_prompt_tokens\)", str(e.value))
    assert m, str(e.value)
    at_least = int(m.group(1).replace(",", ""))
    assert 20 < at_least <= _engine_lengths(tokenizer, task)[1]


def test_context_length_reads_the_usual_names():
    assert context_length(SimpleNamespace(max_position_embeddings=4096)) == 4096
    assert context_length(SimpleNamespace(n_positions=1024)) == 1024  # GPT-2 style
    assert context_length(SimpleNamespace()) is None
