"""Function-calling task: loading both row formats and the structural-match reward."""
from __future__ import annotations

import json

import pytest

from gearlab.tasks.registry import get_task
from gearlab.tasks.fncall import load_fncall_rows, parse_calls, score_calls


def tc(name, **args) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


WEATHER = [{"name": "get_weather", "arguments": {"city": ["Lisbon"]}}]
PARALLEL = [
    {"name": "get_weather", "arguments": {"city": ["Paris"]}}, {"name": "set_timer", "arguments": {"minutes": [5]}}
]


def test_correct_call():
    assert score_calls(tc("get_weather", city="Lisbon"), WEATHER) == (1.0, "ok")
    # casefold/strip
    assert score_calls("Sure. " + tc("get_weather", city=" lisbon ") + " done", WEATHER) == (1.0, "ok")
    args_as_string = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Lisbon\\"}"}</tool_call>'
    assert score_calls(args_as_string, WEATHER) == (1.0, "ok")


def test_wrong_arguments():
    assert score_calls(tc("get_weather", city="Porto"), WEATHER) == (0.0, "wrong_arguments")
    assert score_calls(tc("get_weather"), WEATHER) == (0.0, "wrong_arguments")  # required argument missing
    # unexpected
    assert score_calls(tc("get_weather", city="Lisbon", unit="celsius"), WEATHER) == (0.0, "wrong_arguments")
    assert score_calls(tc("set_timer", minutes="5"), [{"name": "set_timer", "arguments": {"minutes": [5]}}])[0] == 0.0
    assert score_calls(tc("set_timer", minutes=True), [{"name": "set_timer", "arguments": {"minutes": [1]}}])[0] == 0.0


def test_wrong_name_and_count():
    assert score_calls(tc("get_forecast", city="Lisbon"), WEATHER) == (0.0, "wrong_name")
    assert score_calls(tc("get_weather", city="Lisbon") * 2, WEATHER) == (0.0, "wrong_count")


@pytest.mark.parametrize("text", ["get_weather(city='Lisbon')", "<tool_call>{'name': 'get_weather'}</tool_call>",
                                  '<tool_call>{"arguments": {"city": "Lisbon"}}</tool_call>',
                                  '<tool_call>{"name": "get_weather", "arguments": ["Lisbon"]}</tool_call>',
                                  '<tool_call>{"name": "get_weather", "arguments": {"city": "Lisbon"}</tool_call>',
                                  '<tool_call>{"name": "get_weather", "arguments": {"city": "Lisbon"}}'])
def test_malformed(text):
    assert score_calls(text, WEATHER) == (0.0, "malformed")


def test_parallel_calls_any_order_unless_ordered():
    a, b = tc("get_weather", city="Paris"), tc("set_timer", minutes=5)
    assert score_calls(a + b, PARALLEL) == (1.0, "ok") and score_calls(b + a, PARALLEL) == (1.0, "ok")
    assert score_calls(b + a, PARALLEL, ordered=True) == (0.0, "wrong_name")
    same = [{"name": "set_timer", "arguments": {"minutes": [5]}}, {"name": "set_timer", "arguments": {"minutes": [25]}}]
    assert score_calls(tc("set_timer", minutes=25) + tc("set_timer", minutes=5), same)[0] == 1.0
    # a matching, not a cover
    assert score_calls(tc("set_timer", minutes=25) + tc("set_timer", minutes=25), same)[0] == 0.0


def test_bfcl_acceptable_values_and_optional_arguments(tmp_path):
    row = {"question": [[{"role": "user", "content": "Find books by Le Guin."}]], "function": [],
           "ground_truth": [{"search_books": {"author": ["Ursula K. Le Guin", "Ursula Le Guin"], "limit": ["", 10]}}]}
    f = tmp_path / "bfcl.json"
    f.write_text(json.dumps([row]))
    (p,) = load_fncall_rows(f)
    exp = p.meta["expected"]
    assert p.prompt == "Find books by Le Guin."
    assert score_calls(tc("search_books", author="Ursula Le Guin"), exp)[0] == 1.0  # optional limit left out
    assert score_calls(tc("search_books", author="Ursula Le Guin", limit=10.0), exp)[0] == 1.0  # 10 == 10.0
    assert score_calls(tc("search_books", author="Ursula Le Guin", limit=3), exp)[0] == 0.0
    assert score_calls(tc("search_books", limit=10), exp)[0] == 0.0  # required author missing


def test_sample_task_and_reward(tokenizer):
    t = get_task("fncall")
    train, test = t.problems("train", 30, seed=0), t.problems("test", 3, seed=0)
    assert len(train) == 30 and {p.prompt for p in train}.isdisjoint({p.prompt for p in test})
    p = next(q for q in t.rows if q.prompt == "Convert 250 euros to yen.")
    assert t.reward(p, tc("convert_currency", amount=250, **{"from": "EUR", "to": "JPY"})) == 1.0
    assert t.reward(p, tc("convert_currency", amount=250, **{"from": "EUR", "to": "USD"})) == 0.0
    msgs = t.messages(p)
    assert msgs[0]["role"] == "system" and '"convert_currency"' in msgs[0]["content"] and msgs[1]["content"] == p.prompt
    assert parse_calls(tc("x", a=1)) == [{"name": "x", "arguments": {"a": 1}}]
    assert tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False).endswith("assistant\n")


@pytest.mark.parametrize("content,msg", [('{"query": "q"}\n', "unknown row format"), ("not json\n",
                                         ":2: not valid JSON"),
                                         ('{"query": "q", "answers": "[oops"}\n', "not valid JSON"),
                                         ('{"query": "", "answers": []}\n', "empty question"),
                                         ('{"query": "q", "answers": [], "split": "dev"}\n', "'split'")])
def test_bad_rows_name_the_line(tmp_path, content, msg):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"query": "ok", "answers": []}\n' + content)
    with pytest.raises(ValueError, match=msg):
        load_fncall_rows(f)
