"""Every registered credit method trains end to end through `gearlab train` on the embedded task
(a few iterations, tiny model), and the turn methods refuse the single-turn task at start-up."""
import subprocess
import sys

import mlflow
import pytest

from gearlab import credit
from gearlab.config import load_config
from gearlab.trainer.train import train

SINGLE_TURN = [n for n in credit.available() if not credit.get(n).requires_turns]
TURN = [n for n in credit.available() if credit.get(n).requires_turns]


@pytest.mark.parametrize("name", SINGLE_TURN)
def test_assigner_trains_end_to_end(name, tmp_path, tiny_model_dir):
    cfg = load_config([f"assigner={name}", f"model.name_or_path={tiny_model_dir}", f"trainer.output_dir={tmp_path}",
                       "trainer.max_steps=2", "rollout.prompts_per_step=2", "rollout.group_size=4",
                       "rollout.max_new_tokens=12", "trainer.progress_bar=false", "algorithm.mini_batches=2",
                       "eval.num_problems=4"])
    res = train(cfg)
    run = mlflow.MlflowClient(res.tracking_uri).get_run(res.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.data.tags["assigner"] == name
    assert run.data.metrics["update/pg_loss"] == run.data.metrics["update/pg_loss"]  # finite, not NaN


@pytest.mark.parametrize("name", TURN)
def test_turn_methods_refuse_a_single_turn_task_at_start_up(name, tmp_path):
    out = subprocess.run([sys.executable, "-m", "gearlab.cli", "train", f"assigner={name}", f"trainer.output_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "single-turn" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not any(tmp_path.iterdir())
