"""vineppo (docs/credit/vineppo.md): each step's tokens get V_j − V_{j−1}, the Monte-Carlo value change of the step,
ignoring the group baseline; it trains through `gearlab train` with the cost of its continuations logged (2 processes
give the run of 1: tests/parallel/test_world_size.py), and refuses what it cannot do in one line."""

import mlflow
import pytest
import torch

from gearlab import credit
from gearlab.config import load_config
from gearlab.core.batch import RolloutBatch
from gearlab.trainer.train import train

MC = "mc_step_advantage"


def test_step_advantages_pass_through_on_generated_tokens_only():
    mask = [[1, 1, 1, 0], [1, 1, 0, 0]]
    sig = torch.tensor([[0.5, 0.5, -0.25, 9.0], [0.0, 1.0, 9.0, 9.0]])  # junk on padding must come out 0
    for adv in (torch.tensor([1.0, -1.0]), torch.zeros(2)):  # no group baseline: A_i does not enter
        out = credit.build("vineppo").assign(RolloutBatch.from_masks(mask), adv, {MC: sig})
        assert torch.equal(out.token_advantages, torch.tensor([[0.5, 0.5, -0.25, 0.0], [0.0, 1.0, 0.0, 0.0]]))
    assert out.metrics["vineppo/frac_nonzero"] == pytest.approx(4 / 5)
    assert credit.build("vineppo", {"k": 3}).signal_options() == {"mc_k": 3, "mc_max_steps": 8}


def test_gearlab_train_with_vineppo_logs_the_continuations_it_paid_for(tmp_path, tiny_model_dir):
    k = 3
    res = train(load_config([f"model.name_or_path={tiny_model_dir}", f"trainer.output_dir={tmp_path}",
                             "assigner=vineppo", f"assigner.options.k={k}", "assigner.options.max_steps=3",
                             "trainer.max_steps=2", "rollout.prompts_per_step=2", "rollout.group_size=4",
                             "rollout.max_new_tokens=12", "eval.num_problems=0", "trainer.progress_bar=false"]))
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = (res.run_dir / "mlflow_run_id").read_text()
    m = client.get_run(run_id).data.metrics
    n = m["mc/continuations"]
    # every row: K from its prompt, K from each interior step end (at most max_steps − 1 = 2 of them)
    assert n % k == 0 and 8 * k <= n <= 8 * 3 * k
    assert m["mc/tokens"] > 0 and m["mc/seconds"] > 0 and "credit/vineppo/frac_nonzero" in m
    assert sorted(x.step for x in client.get_metric_history(run_id, "mc/continuations")) == [0, 1]


def test_vineppo_on_a_multi_turn_task_credits_turns(tmp_path, tiny_model_dir):
    """tool_arith: steps are turns; each continuation replays its episode in a fresh environment up to its turn."""
    k = 2
    res = train(load_config([f"model.name_or_path={tiny_model_dir}", f"trainer.output_dir={tmp_path}",
                             "task=tool_arith", "assigner=vineppo", f"assigner.options.k={k}",
                             "trainer.max_steps=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
                             "rollout.max_new_tokens=8", "eval.num_problems=0", "trainer.progress_bar=false"]))
    m = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(
        (res.run_dir / "mlflow_run_id").read_text()).data.metrics
    assert m["mc/continuations"] >= 4 * k and m["mc/continuations"] % k == 0  # at least the 4 prompts, K each
    assert "credit/vineppo/frac_nonzero" in m


def test_a_task_that_cannot_replay_is_refused_in_one_line(tmp_path, monkeypatch):
    from gearlab.tasks.tool_arith import ToolArithTask

    monkeypatch.setattr(ToolArithTask, "replayable", False)
    with pytest.raises(ValueError, match="task 'tool_arith' says its environment cannot be replayed"):
        credit.build("vineppo", {}).setup(seed=0, total_steps=1, task=ToolArithTask())
