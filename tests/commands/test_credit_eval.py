"""``gearlab credit-eval`` end to end on a rollout file with planted errors (known positions, known GRPO scores)."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from gearlab.commands.replay import save_rollouts
from gearlab.core.batch import RolloutBatch
from gearlab.rollout.hf import HFRolloutEngine
from gearlab.tasks.registry import get_task

# one problem "3 + 4 * 2" (solution 3+4=7, 7*2=14), four responses: two correct, two with planted errors
COMPLETIONS = [
    "3+4=7\n7*2=14\nAnswer: 14",  # correct
    "3+4=7\n7*2=15\nAnswer: 15",  # miscomputed second step: prefix = the first line
    "3+4=7\n7*2=14\nAnswer: 14",  # correct
    "3+4=7\n7*3=21\nAnswer: 21",  # misread operand in the second step
]


def planted_rollouts(tokenizer, path):
    task = get_task("arith")
    problem = task.make_problem([3, 4, 2], ["+", "*"])
    engine = HFRolloutEngine(tokenizer, task)
    pids, pmask = engine.encode_prompts([problem])
    G = len(COMPLETIONS)
    eos = tokenizer.eos_token_id
    seqs = [tokenizer(c, add_special_tokens=False)["input_ids"] + [eos] for c in COMPLETIONS]
    T = max(map(len, seqs)) + 2  # two padding positions at the end
    resp = torch.full((G, T), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(G, T, dtype=torch.bool)
    for i, s in enumerate(seqs):
        resp[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = True
    texts = tokenizer.batch_decode(resp.masked_fill(~mask, tokenizer.pad_token_id), skip_special_tokens=True)
    assert texts == COMPLETIONS
    rewards = torch.tensor([task.reward(problem, t) for t in texts])
    assert rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    rb = RolloutBatch(prompt_ids=pids.repeat(G, 1), prompt_mask=pmask.repeat(G, 1), response_ids=resp,
                      response_mask=mask,
                      group_ids=torch.zeros(G, dtype=torch.long), rewards=rewards,
                      meta={"answers": [problem.answer] * G, "texts": texts})
    save_rollouts(
        path, rb, [problem], {"model": "planted", "task": "arith", "group_size": G, "seed": 0, "temperature": 1.0}
    )
    return rb


@pytest.mark.slow
def test_credit_eval_scores_planted_errors(tmp_path, tokenizer, tiny_model_dir):
    from gearlab.commands.credit_eval import credit_eval
    from gearlab.config import load_config

    planted_rollouts(tokenizer, tmp_path / "r.pt")
    cfg = load_config([f"model.name_or_path={tiny_model_dir}", f"credit_eval.rollouts={tmp_path / 'r.pt'}",
                       "credit_eval.assigners=[grpo,gear,entropy_adv]", f"credit_eval.out_dir={tmp_path / 'out'}",
                       f"trainer.output_dir={tmp_path}"])
    rec = credit_eval(cfg)
    assert rec["n_trajectories"] == 4 and rec["n_failed"] == 2 and rec["n_failed_located"] == 2
    assert rec["n_located_informative"] == 2
    # controls join gear; every method scored on the same two failed responses
    assert list(rec["assigners"]) == ["grpo", "gear", "entropy_adv", "gear_random", "gear_fixed", "shuffle"]
    g = rec["assigners"]["grpo"]
    assert g["n"] == 2 and g["auroc"] == 0.5 and g["blame_ratio"] == pytest.approx(1.0)
    # GRPO's prefix share is the prefix's share of generated tokens (the first line and its newline / all + stop);
    # exact up to float32 rounding: a token too many or too few in either count moves it by more than 0.015
    n_prefix = len(tokenizer("3+4=7\n", add_special_tokens=False)["input_ids"])
    n_all = [len(tokenizer(c, add_special_tokens=False)["input_ids"]) + 1 for c in (COMPLETIONS[1], COMPLETIONS[3])]
    assert g["prefix_share"] == pytest.approx(sum(n_prefix / n for n in n_all) / 2, abs=1e-6)
    assert "onset_precision" in rec["assigners"]["gear"] and "onset_precision" not in g
    assert set(rec["signals"]) >= {"kl", "entropy"}
    for s in rec["signals"].values():
        assert 0.0 <= s["auroc"] <= 1.0 and s["n"] == 2
    # files and MLflow
    data = json.loads((tmp_path / "out" / "credit_eval.json").read_text())
    assert data["assigners"]["grpo"]["auroc"] == 0.5
    assert "| grpo | 0.500 | 1.000 |" in (tmp_path / "out" / "credit_eval.md").read_text()
    assert (tmp_path / "out" / "credit_eval.png").stat().st_size > 1000
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.get_run(rec["mlflow_run"])
    assert run.data.metrics["credit_eval/grpo/auroc"] == 0.5
    assert {a.path for a in client.list_artifacts(run.info.run_id, "credit_eval")} >= {
        "credit_eval/credit_eval.json", "credit_eval/credit_eval.md", "credit_eval/credit_eval.png"}


def test_credit_eval_scores_vineppo_when_named(tmp_path, tokenizer, tiny_model_dir):
    """Methods that sample extra rollouts run only when named; vineppo then continues the saved responses through
    the engine and is scored on the same located errors as the others."""
    from gearlab.commands.credit_eval import credit_eval, method_names
    from gearlab.config import load_config

    planted_rollouts(tokenizer, tmp_path / "r.pt")
    base = [f"model.name_or_path={tiny_model_dir}", f"credit_eval.rollouts={tmp_path / 'r.pt'}",
            f"credit_eval.out_dir={tmp_path / 'out'}", f"trainer.output_dir={tmp_path}"]
    assert "vineppo" not in method_names(load_config(base), get_task("arith"))
    rec = credit_eval(load_config([*base, "credit_eval.assigners=[grpo,vineppo]"]))
    v = rec["assigners"]["vineppo"]
    assert v["n"] == 2 and 0.0 <= v["auroc"] <= 1.0
    assert rec["assigner_metrics"]["vineppo"]["vineppo/frac_nonzero"] > 0


@pytest.mark.slow
def test_credit_eval_unknown_method_is_one_line(tmp_path, tiny_model_dir):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "gearlab.cli", "credit-eval", f"model.name_or_path={tiny_model_dir}",
                          "credit_eval.assigners=[grpo,nope]", f"trainer.output_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith(
        "gearlab: error: key 'credit_eval.assigners': unknown ['nope']"
    )


def test_score_batch_reads_onsets_from_segments():
    from gearlab.commands.credit_eval import score_batch

    mask = torch.ones(1, 6, dtype=torch.bool)
    err = torch.zeros(1, 6, dtype=torch.bool)
    err[0, 3:5] = True
    seg = torch.tensor([[-1, 0, 0, -1, 1, 1]])  # onsets at 1 (prefix) and 4 (inside the wrong step)
    res = {"seq_adv": torch.tensor([-1.0]), "credit": {"gear": -torch.ones(1, 6)}, "segments": {"gear": seg},
           "signals": {"teacher_logprobs": torch.tensor([[-0.1, -0.1, -0.1, -3.0, -0.1, -0.1]])}}
    rb = RolloutBatch.from_masks(mask)
    out = score_batch(rb, ["gear"], res, err)
    assert out["assigners"]["gear"]["onset_precision"] == 0.5 and out["assigners"]["gear"]["onset_recall"] == 1.0
    # the teacher's surprise (−log π_T) spikes on the wrong step: (1 + 0.5) / 2 over prefix [0, 1, 2]
    assert out["signals"]["teacher_surprise"]["auroc"] == pytest.approx(0.75)
    assert not math.isnan(out["assigners"]["gear"]["auroc"])


def test_reasoning_errors_leave_out_wrong_final_answers(tokenizer):
    """The second table: a wrong final answer after a correct chain is located (at the answer line) but is not a
    reasoning error; only the rows whose first error starts before the final-answer span are scored there."""
    from gearlab.commands.credit_eval import reasoning_error_scores, score_batch
    from gearlab.signals.spans import locate_errors

    task = get_task("arith")
    problem = task.make_problem([3, 4, 2], ["+", "*"])
    texts = COMPLETIONS + ["3+4=7\n7*2=14\nAnswer: 15"]  # row 4: the chain is right, the answer is not
    eos = tokenizer.eos_token_id
    seqs = [tokenizer(c, add_special_tokens=False)["input_ids"] + [eos] for c in texts]
    G, T = len(texts), max(map(len, seqs))
    resp = torch.full((G, T), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(G, T, dtype=torch.bool)
    for i, s in enumerate(seqs):
        resp[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = True
    rewards = torch.tensor([task.reward(problem, t) for t in texts])
    rb = RolloutBatch(prompt_ids=torch.ones(G, 2, dtype=torch.long), prompt_mask=torch.ones(G, 2, dtype=torch.long),
                      response_ids=resp, response_mask=mask, group_ids=torch.zeros(G, dtype=torch.long),
                      rewards=rewards,
                      meta={"answers": [problem.answer] * G, "texts": texts})
    error, _ = locate_errors(task, tokenizer, rb, [problem] * G)
    assert error.any(dim=1).tolist() == [False, True, False, True, True]
    from gearlab.core.grpo import group_advantages

    seq_adv = group_advantages(rewards, rb.group_ids)
    blame_answer = torch.zeros(G, T)  # a method that blames only row 4's error tokens, GRPO elsewhere
    blame_answer[mask] = 1.0
    blame_answer = blame_answer * seq_adv[:, None]
    blame_answer[4] = torch.where(error[4], 3.0 * seq_adv[4], 0.5 * seq_adv[4]) * mask[4]
    res = {"seq_adv": seq_adv, "credit": {"grpo": seq_adv[:, None] * mask, "answer": blame_answer}, "segments": {},
           "signals": {}}
    full = score_batch(rb, ["grpo", "answer"], res, error)
    early = reasoning_error_scores(rb, ["grpo", "answer"], res, error, tokenizer)
    assert full["assigners"]["grpo"]["n"] == 3 and full["assigners"]["answer"]["auroc"] > 0.5
    assert early["n_located"] == 2 and early["n_located_informative"] == 2
    assert early["assigners"]["grpo"]["n"] == 2 and early["assigners"]["answer"]["auroc"] == 0.5  # row 4 left out


def test_spearman_with_ties_and_constant_credit():
    from gearlab.commands.credit_eval_mc import _spearman

    assert _spearman(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([10.0, 20.0, 30.0, 40.0])) == pytest.approx(1.0)
    assert _spearman(torch.tensor([1.0, 2.0, 2.0]), torch.tensor([3.0, 2.0, 2.0])) == pytest.approx(-1.0)
    # a method whose credit is one value per response (GRPO) ranks nothing: NaN, not a rounding artefact
    assert math.isnan(_spearman(torch.tensor([0.3, 0.3 + 1e-9, 0.3]), torch.tensor([1.0, -1.0, 0.0])))


@pytest.mark.slow
def test_gearlab_credit_eval_against_monte_carlo_onsets(tmp_path):
    """`gearlab credit-eval credit_eval.truth=both` on the embedded task (CPU, about a minute at the defaults): every
    response continued from each step end, the methods scored against the MC onsets, and the MC onset checked
    against the located first error."""
    r = subprocess.run([sys.executable, "-m", "gearlab.cli", "credit-eval", "credit_eval.truth=both",
                        "credit_eval.prompts=32", "credit_eval.mc_k=4", "credit_eval.assigners=[grpo,gear,oar_p]",
                        "credit_eval.controls=false", f"trainer.output_dir={tmp_path}",
                        f"credit_eval.out_dir={tmp_path / 'out'}"], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((tmp_path / "out" / "credit_eval.json").read_text())
    mc = rec["mc"]
    assert mc["k"] == 4 and mc["n_failed"] == rec["n_failed"] and 0 < mc["n_with_onset"] <= mc["n_failed"]
    assert set(mc["assigners"]) == {"grpo", "gear", "oar_p"} and mc["assigners"]["grpo"]["auroc"] == 0.5
    assert mc["rank_corr"]["grpo"]["n"] == 0  # constant within a response
    assert mc["cost"]["continuations"] % 4 == 0 and mc["cost"]["tokens"] > 0
    assert mc["agreement"]["n"] > 0 and 0.5 < mc["agreement"]["onset_holds_first_error"] <= 1.0
    kp = mc["kl_peak"]  # gear asked for the teacher KL: where its peak lies against the MC onset
    assert kp["n"] == mc["n_with_onset"] and sum(kp["offset_hist"].values()) == kp["n"]
    assert 0 <= kp["share_in_onset_step"] <= 1 and 0 < kp["chance"] <= 1
    assert "credit vs Monte-Carlo onsets" in (tmp_path / "out" / "credit_eval.md").read_text()


@pytest.mark.parametrize("deterministic", [True, False])
def test_credit_eval_on_a_card_scores_under_trainer_deterministic(monkeypatch, deterministic):
    """The scores repeat on a card only if the evaluation's rollouts and signals run with the training run's
    deterministic kernels; PyTorch's setting is back afterwards (the CPU scoring itself is shown by the tests above)."""
    from gearlab.commands import credit_eval as ce
    from gearlab.config import load_config

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # set by the context: gone after the test
    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    seen = []
    monkeypatch.setattr(ce, "_evaluate", lambda *a: seen.append(torch.are_deterministic_algorithms_enabled()) or {})
    try:
        ce.credit_eval(load_config([f"trainer.deterministic={str(deterministic).lower()}"]))
        assert seen == [deterministic] and not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
