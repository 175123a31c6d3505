"""Maths tasks: math-verify reward, row formats (GSM8K / MATH / AIME / generic), file loading, splits."""
from __future__ import annotations

import json
import sys
import threading
import types

import pandas as pd
import pytest

from gearlab.tasks.registry import get_task
from gearlab.tasks.math import (
    SAMPLES,
    last_boxed,
    load_math_problems,
    math_reward,
    row_to_problem,
)

SAMPLE_TASKS = ["gsm8k", "math", "math500", "aime"]


@pytest.mark.parametrize("completion, gold", [
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("So $x = \\boxed{0.5}$.", "\\frac{1}{2}"),
    ("The answer is \\boxed{42}.", "42"),
    ("\\boxed{(1,2)}", "(1,2)"),
    ("\\boxed{\\sqrt{18}}", "3\\sqrt{2}"),
    ("\\boxed{\\dfrac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),
    ("\\boxed{1,234}", "1234"),
    ("no box, but the final answer is 7", "7"),
])
def test_reward_equivalent(completion, gold):
    assert math_reward(completion, gold) == 1.0


@pytest.mark.parametrize("completion, gold", [
    ("The answer is \\boxed{41}.", "42"),
    ("\\boxed{(2,1)}", "(1,2)"),
    ("\\boxed{\\frac{1}{3}}", "0.5"),
    ("lorem ipsum }}{{ \\boxed{", "42"),
    ("\\boxed{}", "42"),
    ("", "42"),
    (None, "42"),
])
def test_reward_wrong_or_garbage(completion, gold):
    assert math_reward(completion, gold) == 0.0


def test_last_box_wins():
    assert math_reward("First \\boxed{41}, no wait: \\boxed{42}.", "42") == 1.0
    assert math_reward("First \\boxed{42}, no wait: \\boxed{41}.", "42") == 0.0


def test_reward_from_other_thread():
    results: dict[str, object] = {}

    def work() -> None:
        try:
            results["ok"] = math_reward("\\boxed{\\frac{1}{2}}", "0.5")
            results["bad"] = math_reward("\\boxed{3}", "0.5")
        except Exception as e:  # must not happen: the signal-based timeouts are off in threads
            results["error"] = e

    t = threading.Thread(target=work)
    t.start()
    t.join(timeout=30)
    assert results == {"ok": 1.0, "bad": 0.0}


def test_last_boxed_nested_and_escaped():
    assert last_boxed("x = \\boxed{\\frac{\\sqrt{3}}{2}}.") == "\\frac{\\sqrt{3}}{2}"
    assert last_boxed("\\boxed{1} then \\boxed{\\{1,2\\}}") == "\\{1,2\\}"
    assert last_boxed("\\boxed 5$.") == "5"
    assert last_boxed("\\boxed{\\frac{1}{2}") is None  # unclosed (truncated completion)
    assert last_boxed("no box") is None


def test_gsm8k_row():
    p = row_to_problem({"question": "How many?", "answer": "It is 1000+234=<<1000+234=1234>>1234.\n#### 1,234"},
                       "f.jsonl: line 1")
    assert p.answer == "1234" and p.meta["format"] == "gsm8k"
    assert p.solution == "It is 1000+234=1234." and "####" not in p.solution
    assert p.prompt == "How many?\nPut the final answer in \\boxed{}."


def test_math_row_boxed_extraction_and_explicit_answer():
    row = {"problem": "Compute $\\cos 30^\\circ$.", "solution": "It is $\\boxed{\\frac{\\sqrt{3}}{2}}$.",
           "level": "Level 2", "type": "Precalculus"}
    p = row_to_problem(row, "f: row 1")
    assert p.answer == "\\frac{\\sqrt{3}}{2}" and p.meta["format"] == "math"
    assert p.meta["level"] == "Level 2" and p.meta["type"] == "Precalculus"
    p = row_to_problem({**row, "answer": "$\\frac{\\sqrt3}{2}$"}, "f: row 1")
    assert p.answer == "\\frac{\\sqrt3}{2}"  # explicit answer wins, $...$ stripped


def test_aime_and_generic_rows():
    p = row_to_problem({"ID": "2024-I-1", "Problem": "Find N.", "Answer": 204, "year": 2024}, "f: row 1")
    assert (p.answer, p.meta["format"], p.meta["ID"], p.meta["year"]) == ("204", "aime", "2024-I-1", 2024)
    p = row_to_problem({"question": "Find M.", "answer": 7}, "f: row 2")
    assert (p.answer, p.meta["format"]) == ("7", "aime")
    p = row_to_problem({"prompt": "What is 2+2?", "answer": "4"}, "f: row 3", template="Q: {problem}")
    assert (p.prompt, p.answer, p.meta["format"]) == ("Q: What is 2+2?", "4", "prompt")


@pytest.mark.parametrize("name", SAMPLE_TASKS)
def test_samples_load_with_disjoint_splits(name):
    task = get_task(name, path="sample")
    train, test = task.pools["train"], task.pools["test"]
    assert train and test
    assert not {p.meta["problem"] for p in train} & {p.meta["problem"] for p in test}
    assert all("\\boxed{}" in p.prompt for p in train + test)
    assert task.problems("train", 5, seed=1) == task.problems("train", 5, seed=1)
    many = task.problems("test", 3 * len(test), seed=0)  # cycles through the pool, each row equally often
    assert len(many) == 3 * len(test) and all(many.count(p) == 3 for p in test)
    msg = task.messages(train[0], privileged=True)[-1]["content"]
    assert train[0].answer in msg


@pytest.mark.parametrize("name", ["gsm8k", "math500", "aime"])
def test_sample_gold_matches_own_solution(name):
    task = get_task(name, path="sample")
    for p in task.pools["train"] + task.pools["test"]:
        assert p.solution, p
        assert math_reward(p.solution, p.answer) == 1.0, (p.answer, p.solution)
        assert task.reward(p, f"Work...\n\\boxed{{{p.answer}}}") == 1.0
        assert task.reward(p, "\\boxed{-1}") == 0.0


def test_extract_answer():
    task = get_task("math500", path="sample")
    assert task.extract_answer("so \\boxed{1} or rather \\boxed{ \\frac{1}{2} }.") == "\\frac{1}{2}"
    assert task.extract_answer("42") is None


def test_parquet_and_json_list(tmp_path):
    rows = [{"problem": f"What is {i}+{i}?", "answer": 2 * i, "split": "test" if i < 2 else "train"} for i in range(6)]
    pq = tmp_path / "aime.parquet"
    pd.DataFrame(rows).to_parquet(pq)
    js = tmp_path / "aime.json"
    js.write_text(json.dumps(rows))
    for path in (pq, js):
        probs = load_math_problems(path)
        assert [p.answer for p in probs] == [str(2 * i) for i in range(6)]
        task = get_task("aime", path=str(path))
        assert len(task.pools["test"]) == 2 and len(task.pools["train"]) == 4
        assert task.reward(task.pools["test"][0], "\\boxed{0}") == 1.0


def test_separate_test_file(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(4)))
    test = tmp_path / "test.jsonl"
    test.write_text(
        json.dumps({"prompt": "q0", "answer": "0"}) + "\n" + json.dumps({"prompt": "q9", "answer": "9"}) + "\n"
    )
    task = get_task("math", path=str(train), test_path=str(test))
    assert sorted(p.meta["problem"] for p in task.pools["train"]) == ["q1", "q2", "q3"]  # q0 is held out
    assert sorted(p.meta["problem"] for p in task.pools["test"]) == ["q0", "q9"]


def test_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        get_task("gsm8k", path=str(missing))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"question": "q", "answer": "#### 1"}) + "\n\n" + json.dumps({"text": "x", "label": 1}) + "\n"
    )
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 3: unknown row format \(keys: \['label', 'text'\]\)"):
        load_math_problems(bad)
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 1: not valid JSON"):
        load_math_problems(bad)
    bad.write_text(json.dumps({"problem": "p", "solution": "no box here"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 1: no 'answer'"):
        load_math_problems(bad)


def test_hub_id_uses_datasets_when_installed(monkeypatch):
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda repo, config: {  # type: ignore[attr-defined]
        "train": [{"question": "a?", "answer": "x\n#### 1"}], "test": [{"question": "b?", "answer": "y\n#### 2"}]}
    monkeypatch.setitem(sys.modules, "datasets", fake)
    monkeypatch.setattr("gearlab.tasks.math._has_datasets", lambda: True)
    task = get_task("gsm8k", path="someone/gsm8k-like", hub_config="main")
    assert [p.answer for p in task.pools["train"]] == ["1"] and [p.answer for p in task.pools["test"]] == ["2"]


@pytest.mark.parametrize("name, rows", [("gsm8k", 8), ("math", 8), ("math500", 8), ("aime", 6)])
def test_no_path_refuses_naming_the_key_and_the_sample(name, rows):
    from gearlab.config import ConfigError, load_config
    from gearlab.tasks.registry import task_from_config

    sample = SAMPLES["math500" if name == "math" else name].name
    with pytest.raises(ConfigError) as e:
        task_from_config(load_config([f"task={name}"]))
    assert str(e.value) == (f"key 'task.options.path': no data file given; set task.options.path=FILE (JSONL, JSON "
                            f"or parquet, or a hub id), or task.options.path=sample to use the {rows}-row test sample "
                            f"gearlab/tasks/data/{sample}")
    # the explicit opt-in is the shipped file
    assert get_task(name, path="sample").path == str(SAMPLES["math500" if name == "math" else name])


def test_train_without_a_data_path_is_one_line_exit_2(tmp_path, capsys):
    from gearlab.cli import main

    assert main(["train", "task=gsm8k", f"trainer.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gearlab: error: key 'task.options.path': no data file given;")
    assert "task.options.path=sample" in err[0]
    assert not any(tmp_path.iterdir())  # refused before any work


def test_samples_are_packaged_jsonl():
    assert all(p.suffix == ".jsonl" and p.is_file() for p in SAMPLES.values())
