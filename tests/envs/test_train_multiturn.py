"""Multi-turn training end to end: `gearlab train` on the embedded tool task with a briefly
warm-started tiny model (it already emits calls), for the turn methods and GEAR; the function-calling
task trains too."""
from __future__ import annotations

import mlflow
import pytest

from gearlab.config import load_config
from gearlab.train import train

SMALL = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128)


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    from gearlab.warmstart import warmstart

    d = tmp_path_factory.mktemp("tool_model")
    warmstart(d, task="tool_arith", steps=50, batch_size=16, lr=5e-3, n_eval=0, model_kwargs=SMALL, verbose=False)
    return d


@pytest.mark.parametrize("name", ["mt_grpo", "gigpo", "gear"])
def test_multi_turn_training(name, tmp_path, tool_model_dir):
    cfg = load_config([f"assigner={name}", "task=tool_arith", f"model.name_or_path={tool_model_dir}",
                       f"trainer.output_dir={tmp_path}", "trainer.max_steps=2", "rollout.prompts_per_step=2",
                       "rollout.group_size=4", "rollout.max_new_tokens=32", "trainer.progress_bar=false",
                       "eval.num_problems=4"])
    res = train(cfg)
    run = mlflow.MlflowClient(res.tracking_uri).get_run(res.mlflow_run_id)
    m = run.data.metrics
    assert run.info.status == "FINISHED" and run.data.tags["task"] == "tool_arith"
    assert m["rollout/tool_call_frac"] > 0 and m["rollout/turns_mean"] > 1 and m["rollout/env_tokens_mean"] > 0
    assert m["update/pg_loss"] == m["update/pg_loss"]
    assert "eval/greedy_tool_call_frac" in m and "eval/greedy_finish_frac" in m
    ends = sum(v for k, v in m.items() if k.startswith("rollout/end_"))
    assert ends == pytest.approx(1.0)
    if name != "gear":
        assert m["credit/turns_mean"] > 1


def test_function_calling_trains(tmp_path, tiny_model_dir):
    cfg = load_config(["task=fncall", f"model.name_or_path={tiny_model_dir}", f"trainer.output_dir={tmp_path}",
                       "trainer.max_steps=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
                       "rollout.max_new_tokens=8", "trainer.progress_bar=false", "eval.num_problems=2"])
    res = train(cfg)
    assert mlflow.MlflowClient(res.tracking_uri).get_run(res.mlflow_run_id).info.status == "FINISHED"
