"""Every registered credit method trains end to end through `gearlab train` on the embedded task
(a few iterations, tiny model), and the turn methods refuse the single-turn task at start-up."""
import hashlib
import math
import subprocess
import sys

import mlflow
import pytest
import torch
from safetensors.torch import load_file

from gearlab import credit
from gearlab.config import load_config
from gearlab.tasks.arithmetic import ArithmeticTask
from gearlab.trainer.train import train

SINGLE_TURN = [n for n in credit.available() if not credit.get(n).requires_turns]
TURN = [n for n in credit.available() if credit.get(n).requires_turns]


def _text_hash_reward(self, problem, completion: str) -> float:
    """0 or 1 from a hash of the completion: varies across a group's samples, deterministic for a given text."""
    return float(hashlib.sha256(completion.encode()).digest()[0] % 2)


@pytest.mark.parametrize("name", SINGLE_TURN)
def test_assigner_trains_end_to_end(name, tmp_path, tiny_model_dir, monkeypatch):
    # a random tiny model never answers right: with the task's own reward every advantage is 0 and nothing updates
    monkeypatch.setattr(ArithmeticTask, "reward", _text_hash_reward)
    cfg = load_config([f"assigner={name}", f"model.name_or_path={tiny_model_dir}", f"trainer.output_dir={tmp_path}",
                       "trainer.max_steps=2", "rollout.prompts_per_step=2", "rollout.group_size=4",
                       "rollout.max_new_tokens=12", "trainer.progress_bar=false", "algorithm.mini_batches=2",
                       "eval.num_problems=4"])
    res = train(cfg)
    run = mlflow.MlflowClient(res.tracking_uri).get_run(res.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.data.tags["assigner"] == name
    assert math.isfinite(run.data.metrics["update/pg_loss"]) and math.isfinite(run.data.metrics["update/grad_norm"])
    before = load_file(tiny_model_dir / "model.safetensors")
    after = load_file(res.run_dir / "final" / "model.safetensors")
    assert after.keys() == before.keys() and all(torch.isfinite(t).all() for t in after.values())
    moved = {k: (after[k].float() - before[k].float()).abs().max().item() for k in before}
    assert [k for k, d in moved.items() if d == 0] == []  # the assigned credit reached every weight tensor
    # Adam moves an element by about lr per optimizer step (its first step by exactly lr · sign(g)), at most
    # (1 - β1) / sqrt(1 - β2) ≈ 3.2 lr; 2 iterations × 2 mini-batches = 4 steps
    lr, steps = cfg.optim.lr, cfg.trainer.max_steps * cfg.algorithm.mini_batches * cfg.algorithm.ppo_epochs
    assert lr / 2 <= max(moved.values()) <= steps * 3.2 * lr


@pytest.mark.parametrize("name", TURN)
def test_turn_methods_refuse_a_single_turn_task_at_start_up(name, tmp_path):
    out = subprocess.run([sys.executable, "-m", "gearlab.cli", "train", f"assigner={name}",
                         f"trainer.output_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "single-turn" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not any(tmp_path.iterdir())
