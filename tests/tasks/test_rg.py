"""task=rg: reasoning-gym datasets as gearlab tasks — seeded splits that never share a question, the dataset's own
scorer as the reward, mixtures by weight, options passed through, one-line errors for bad options, located errors,
and a short `gearlab train` on the CPU."""
from __future__ import annotations

import collections
import subprocess
import sys

import pytest

from gearlab.config import ConfigError
from gearlab.tasks.registry import get_task
from gearlab.tasks.rg import extract_tagged_answer


@pytest.mark.parametrize("options", [{"dataset": "gsm_symbolic"}, {"dataset": {"chain_sum": 1, "products": 1}}])
def test_splits_never_share_a_question_and_are_seeded(options):
    task = get_task("rg", **options)
    train, test = task.problems("train", 600, seed=0), task.problems("test", 150, seed=0)
    assert len(train) == 600 and len(test) == 150
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert not {p.prompt for p in train} & {p.prompt for p in task.problems("test", 150, seed=1)}
    assert [p.prompt for p in task.problems("train", 600, seed=0)] == [p.prompt for p in train]
    assert [p.prompt for p in task.problems("train", 50, seed=0)] == [p.prompt for p in train[:50]]  # a prefix
    assert [p.prompt for p in task.problems("train", 50, seed=1)] != [p.prompt for p in train[:50]]


def test_the_reward_is_the_datasets_own_score_of_the_tagged_answer():
    task = get_task("rg", dataset="gsm_symbolic")
    p = task.problems("train", 1, seed=3)[0]
    assert p.solution.endswith(f"<answer>{p.answer}</answer>") and "\n" in p.solution  # the worked solution first
    assert task.reward(p, p.solution) == 1.0
    assert task.reward(p, f"so the total is\n<answer>{p.answer}</answer>") == 1.0
    wrong = str(int(p.answer) + 1)
    assert task.reward(p, f"<answer>{wrong}</answer>") == pytest.approx(0.01)  # gsm_symbolic's score of a number
    assert task.reward(p, p.answer) == 0.0  # no tag, no answer
    for odd in ("", "<answer>", "<answer></answer>", "</answer><answer>", "\x00" * 5):
        assert 0.0 <= task.reward(p, odd) <= 0.01
    chain = get_task("rg", dataset="chain_sum").problems("train", 1, seed=0)[0]
    assert chain.solution.endswith(f" = {chain.answer}\n<answer>{chain.answer}</answer>")  # computed, line by line
    legs = get_task("rg", dataset="leg_counting").problems("train", 1, seed=0)[0]
    assert legs.solution == f"<answer>{legs.answer}</answer>"  # no worked solution in this dataset: the answer


def test_the_last_closed_answer_tag_is_the_answer():
    assert extract_tagged_answer("<answer>1</answer> then <answer> 2 </answer>") == "2"
    assert extract_tagged_answer("<answer>1</answer> then <answer>2") == "1"
    assert extract_tagged_answer("no tag") is None


def test_a_mixture_draws_by_weight_and_scores_each_problem_by_its_dataset():
    task = get_task("rg", dataset={"chain_sum": 3, "products": 1}, config={"chain_sum": {"min_terms": 2,
                                                                                        "max_terms": 2}})
    ps = task.problems("train", 800, seed=0)
    counts = collections.Counter(p.meta["dataset"] for p in ps)
    assert 0.70 < counts["chain_sum"] / 800 < 0.80  # 3:1 (binomial sd 1.5%)
    for p in ps[:50]:
        assert task.reward(p, p.solution) == 1.0
        if p.meta["dataset"] == "chain_sum":  # the option reached the dataset: two terms
            assert len(p.meta["entry"]["metadata"]["expression"].replace(" - ", " + ").split(" + ")) == 2


def test_system_prompts():
    assert get_task("rg", system_prompt="none").messages(get_task("rg").problems("train", 1)[0])[0]["role"] == "user"
    msgs = get_task("rg", system_prompt="direct").messages(get_task("rg").problems("train", 1)[0])
    assert msgs[0]["role"] == "system" and "<answer>" in msgs[0]["content"]
    assert get_task("rg", system_prompt="Be brief.").system_prompt == "Be brief."


@pytest.mark.parametrize("options, message", [
    ({"dataset": "gsm_symbolik"}, "key 'task.options.dataset': unknown reasoning-gym dataset 'gsm_symbolik' "
                                  "(did you mean: ['gsm_symbolic'])"),
    ({"dataset": "chain_sum", "config": {"min_term": 2}}, "key 'task.options.config': reasoning-gym dataset "
                                                          "'chain_sum' has no option 'min_term' (its options: "),
    ({"dataset": "chain_sum", "config": {"min_terms": 0}}, "rejects {'min_terms': 0}: min_terms must be positive"),
    ({"dataset": {"chain_sum": 1}, "config": {"products": {}}}, "'products' is not a dataset of the mixture"),
    ({"dataset": {"chain_sum": 0}}, "key 'task.options.dataset': needs a dataset name or positive weights"),
    ({"test_fraction": 1.0}, "key 'task.options.test_fraction': must be in (0, 1)"),
])
def test_bad_options_are_one_line_errors_naming_the_key(options, message):
    with pytest.raises(ConfigError) as e:
        get_task("rg", **options)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_options_stop_gearlab_train_with_exit_2_before_any_work(tmp_path, tiny_model_dir):
    r = subprocess.run([sys.executable, "-m", "gearlab.cli", "train", "task=rg", "task.options.dataset=chain_sum",
                        "task.options.config.max_term=3", f"model.name_or_path={tiny_model_dir}",
                        f"trainer.output_dir={tmp_path / 'out'}"], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert "has no option 'max_term'" in lines[0] and not (tmp_path / "out").exists()


def test_located_errors_through_the_task():
    task = get_task("rg", dataset="gsm_symbolic")
    p = task.problems("train", 1, seed=1)[0]
    assert task.locate_error(p, p.solution) is None  # correct
    wrong = p.solution.replace(f"<answer>{p.answer}</answer>", "<answer>7</answer>")
    s, e = task.locate_error(p, wrong)
    assert wrong[s:e] == "<answer>7</answer>"  # a correct chain, a wrong final answer: blamed at the answer
    unsupported = get_task("rg", dataset="leg_counting").problems("train", 1)[0]
    assert get_task("rg", dataset="leg_counting").locate_error(unsupported, "<answer>0</answer>") is None


@pytest.mark.parametrize("dataset", ["chain_sum", "gsm_symbolic"])
def test_gearlab_train_on_a_reasoning_gym_dataset(tmp_path, tiny_model_dir, dataset):
    """A short run on the CPU (the tiny model folder: no warm start), evaluation and credit included."""
    import mlflow

    r = subprocess.run([sys.executable, "-m", "gearlab.cli", "train", "task=rg", f"task.options.dataset={dataset}",
                        "task.options.system_prompt=none", f"model.name_or_path={tiny_model_dir}",
                        "trainer.max_steps=2", "rollout.prompts_per_step=2", "rollout.group_size=4",
                        "rollout.max_new_tokens=16", "eval.num_problems=4", "trainer.progress_bar=false",
                        "assigner=gear", f"trainer.output_dir={tmp_path}"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "key 'rollout.max_new_tokens': 16 tokens cut 64 of 64 worked solutions of task 'rg'" in r.stderr  # a smoke
    c = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = c.search_runs([c.get_experiment_by_name("gearlab").experiment_id])
    m = run.data.metrics
    assert run.info.status == "FINISHED" and m["train/iteration"] == 2 and "eval/greedy_accuracy" in m
    assert run.data.params["task.name"] == "rg" and run.data.params["task.options.dataset"] == dataset


def test_credit_eval_scores_methods_against_planted_gsm_errors(tmp_path, tokenizer, tiny_model_dir):
    """`gearlab credit-eval` on gsm_symbolic responses with planted errors: every failed response located (a
    miscomputed line, a misread quantity) and the methods scored on them."""
    import torch

    from gearlab.commands.credit_eval import credit_eval
    from gearlab.commands.replay import save_rollouts
    from gearlab.config import load_config
    from gearlab.core.batch import RolloutBatch
    from gearlab.rollout.hf import HFRolloutEngine

    task = get_task("rg", dataset="gsm_symbolic", system_prompt="none")
    problem = task.problems("train", 1, seed=1)[0]
    lines = problem.solution.splitlines()
    step = [i for i, ln in enumerate(lines) if "=" in ln and any(c.isdigit() for c in ln)][1]  # a prefix before it
    lhs, rhs = lines[step].rsplit("=", 1)
    result = "".join(c for c in rhs if c.isdigit())
    miscomputed = lines[:step] + [f"{lhs}= {int(result) + 10}"] + lines[step + 1:-1] + ["<answer>1</answer>"]
    misread = lines[:step] + ["999 + 1 = 1000"] + lines[step + 1:-1] + ["<answer>1</answer>"]
    completions = [problem.solution, "\n".join(miscomputed), problem.solution, "\n".join(misread)]
    engine = HFRolloutEngine(tokenizer, task)
    pids, pmask = engine.encode_prompts([problem])
    eos, G = tokenizer.eos_token_id, len(completions)
    seqs = [tokenizer(c, add_special_tokens=False)["input_ids"] + [eos] for c in completions]
    resp = torch.full((G, max(map(len, seqs))), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(resp, dtype=torch.bool)
    for i, s in enumerate(seqs):
        resp[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), True
    texts = tokenizer.batch_decode(resp.masked_fill(~mask, tokenizer.pad_token_id), skip_special_tokens=True)
    rewards = torch.tensor([task.reward(problem, t) for t in texts])
    assert rewards[0] == rewards[2] == 1.0 and rewards[1] < 1 and rewards[3] < 1
    spans = [task.locate_error(problem, t) for t in texts]
    assert texts[1][slice(*spans[1])] == miscomputed[step] and texts[3][slice(*spans[3])] == "999 + 1 = 1000"
    rb = RolloutBatch(prompt_ids=pids.repeat(G, 1), prompt_mask=pmask.repeat(G, 1), response_ids=resp,
                      response_mask=mask, group_ids=torch.zeros(G, dtype=torch.long), rewards=rewards,
                      meta={"answers": [problem.answer] * G, "texts": texts})
    save_rollouts(tmp_path / "r.pt", rb, [problem],
                  {"model": "planted", "task": "rg", "group_size": G, "seed": 0, "temperature": 1.0})
    cfg = load_config(["task=rg", "task.options.dataset=gsm_symbolic", "task.options.system_prompt=none",
                       f"model.name_or_path={tiny_model_dir}", f"credit_eval.rollouts={tmp_path / 'r.pt'}",
                       "credit_eval.assigners=[grpo,gear]", f"credit_eval.out_dir={tmp_path / 'out'}",
                       f"trainer.output_dir={tmp_path}"])
    rec = credit_eval(cfg)
    assert rec["n_trajectories"] == 4 and rec["n_failed"] == 2 and rec["n_failed_located"] == 2
    assert rec["assigners"]["grpo"]["n"] == 2 and rec["assigners"]["grpo"]["auroc"] == 0.5
    assert 0.0 <= rec["assigners"]["gear"]["auroc"] <= 1.0
