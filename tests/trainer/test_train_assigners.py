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


def test_oar_g_skipping_the_zero_rows_trains_the_same_weights(tmp_path, monkeypatch):
    """signals.skip_zero_rows: OAR-G's saliency only for the rows with A_i != 0 gives the same credit, so the same
    run: equal final weights and credit metrics (one row per micro-batch, so no row's forward depends on which
    others are computed), while the saliency pass really left rows out. The embedded warm-started model writes
    worked solutions, so rows have reasoning lines, groups of mixed and of equal rewards."""
    import gearlab.signals.provider as provider
    from gearlab.signals.registry import SignalContext

    seen: list[list[bool] | None] = []

    class Spy(SignalContext):
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            seen.append(None if self.rows is None else self.rows.tolist())

    monkeypatch.setattr(provider, "SignalContext", Spy)
    runs = {}
    for skip in (True, False):
        cfg = load_config(["assigner=oar_g", "model.name_or_path=embedded:tiny-arith",
                           f"trainer.output_dir={tmp_path / str(skip)}", "trainer.max_steps=2",
                           "rollout.prompts_per_step=4", "rollout.group_size=4", "trainer.progress_bar=false",
                           "algorithm.micro_batch_size=1", "eval.num_problems=2",
                           f"signals.skip_zero_rows={str(skip).lower()}"])
        res = train(cfg)
        metrics = mlflow.MlflowClient(res.tracking_uri).get_run(res.mlflow_run_id).data.metrics
        runs[skip] = (load_file(res.run_dir / "final" / "model.safetensors"),
                      {k: v for k, v in metrics.items() if k.startswith(("credit/", "update/"))})
    wanted = [r for r in seen if r is not None]
    assert len(wanted) == 2 and all(any(r) and not all(r) for r in wanted)  # both iterations left rows out
    assert seen.count(None) == 2  # and without the option, none
    (w_skip, m_skip), (w_all, m_all) = runs[True], runs[False]
    assert all(torch.equal(w_skip[k], w_all[k]) for k in w_all)
    assert m_skip == m_all and m_all["credit/weight_std"] > 0 and m_all["credit/saliency_mean"] > 0
