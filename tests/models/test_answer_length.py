"""rollout.max_new_tokens against the task's worked solutions: a budget that cuts most of them before their answer
gives a run of all-zero rewards, so it is named with the numbers and the value that fits."""
import json
import statistics
import subprocess
import sys


from gearlab.config import load_config
from gearlab.models.answer_length import answer_budget_warning, answer_lengths
from gearlab.tasks.registry import task_from_config


def _setup(*overrides: str):
    cfg = load_config(list(overrides))
    return cfg, task_from_config(cfg)


def test_lengths_are_the_solutions_tokens_plus_eos(tokenizer):
    cfg, task = _setup("task=arith")
    problems = task.problems("train", 8, seed=3)
    expected = [len(tokenizer(p.solution, add_special_tokens=False)["input_ids"]) + 1 for p in problems]
    assert answer_lengths(task, tokenizer, 8, seed=3) == expected
    assert min(expected) > 10  # each is a worked solution, not an empty string


def test_a_budget_under_the_median_solution_is_named_with_the_value_that_fits(tokenizer):
    cfg, task = _setup("task=rg", "task.options.dataset=gsm_symbolic", "rollout.max_new_tokens=48")
    lengths = answer_lengths(task, tokenizer, 64, seed=0)
    assert statistics.median(lengths) > 4 * 48  # GSM-style worked solutions in the tiny model's tokens
    w = answer_budget_warning(cfg, task, tokenizer)
    assert w == (f"key 'rollout.max_new_tokens': 48 tokens cut 64 of 64 worked solutions of task 'rg' before their "
                 f"answer (median {statistics.median(lengths):g} tokens, longest {max(lengths)}): a policy that "
                 f"answers as they do scores 0 where it is cut; set rollout.max_new_tokens={max(lengths)} or more")


def test_the_median_decides(tokenizer):
    """Silent at the median solution's length, a warning one token under it (counting the solutions it cuts)."""
    _, task = _setup("task=rg_chain_sum")
    lengths = answer_lengths(task, tokenizer, 64, seed=0)
    median = statistics.median(lengths)
    at = int(median) if median == int(median) else int(median) + 1
    assert answer_budget_warning(load_config(["task=rg_chain_sum", f"rollout.max_new_tokens={at}"]), task,
                                 tokenizer) is None
    w = answer_budget_warning(load_config(["task=rg_chain_sum", f"rollout.max_new_tokens={at - 1}"]), task, tokenizer)
    assert w is not None and f"cut {sum(x > at - 1 for x in lengths)} of 64 " in w


def test_the_presets_budgets_hold_their_tasks_solutions(tokenizer):
    for preset in ("embedded", "arith3_cpu", "arith_hard"):
        cfg, task = _setup(f"experiment={preset}")
        assert answer_budget_warning(cfg, task, tokenizer) is None, preset


def test_tasks_without_solutions_and_multi_turn_tasks_are_not_checked(tmp_path, tokenizer):
    rows = tmp_path / "p.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"What is {i}+1?", "answer": str(i + 1)}) + "\n" for i in range(80)))
    cfg, task = _setup("task=jsonl", f"task.options.train_path={rows}", "rollout.max_new_tokens=1")
    assert answer_lengths(task, tokenizer, 64) == [] and answer_budget_warning(cfg, task, tokenizer) is None
    cfg, task = _setup("task=tool_arith", "rollout.max_new_tokens=1")
    assert task.multi_turn and answer_budget_warning(cfg, task, tokenizer) is None


def test_the_warm_start_of_a_tiny_model_warns_before_it_trains(tmp_path):
    """`gearlab warmstart` of the embedded tiny model on GSM-style solutions: the warning comes before the first step
    (on these demonstrations the default 600 steps take over an hour on two cores)."""
    r = subprocess.run([sys.executable, "-m", "gearlab.cli", "warmstart", "task=rg",
                        "task.options.dataset=gsm_symbolic",
                        "warmstart.steps=1", "warmstart.batch_size=2", "warmstart.n_eval=0",
                        f"trainer.output_dir={tmp_path}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:]
    warn = r.stdout.find("before warm-starting embedded:tiny-arith from scratch: key 'rollout.max_new_tokens': 48 ")
    assert 0 <= warn < r.stdout.index("[warmstart] step    0/1"), r.stdout[-2000:]
