"""vineppo (docs/credit/vineppo.md): each step's tokens get V_j − V_{j−1}, the Monte-Carlo value change of the step,
ignoring the group baseline; it trains through `gearlab train` with the cost of its continuations logged (2 processes
give the run of 1: tests/parallel/test_world_size.py), and refuses what it cannot do in one line."""
import subprocess
import sys

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


@pytest.mark.parametrize("override,msg", [("task=tool_arith", "continues single-turn responses")])
def test_what_vineppo_cannot_do_is_one_line_before_any_work(tmp_path, override, msg):
    r = subprocess.run([sys.executable, "-m", "gearlab.cli", "train", "assigner=vineppo", override,
                        "trainer.accelerator=cpu", f"trainer.output_dir={tmp_path}"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not any(tmp_path.iterdir())
