"""Multi-turn training end to end: `gearlab train` on the embedded tool task with a briefly
warm-started tiny model (it already emits calls), for the turn methods and GEAR; the function-calling
task trains too."""
from __future__ import annotations

import mlflow
import pytest
import torch

from gearlab.config import load_config
from gearlab.trainer.train import train

SMALL = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128)


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    from gearlab.models.warmstart import warmstart

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
    import json
    import shutil

    # the sample's prompts (up to 571 tokens after the chat template) need more context than the tiny model's 512
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    conf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**conf, "max_position_embeddings": 1024}))
    cfg = load_config(["task=fncall", f"model.name_or_path={model}", f"trainer.output_dir={tmp_path}",
                       "trainer.max_steps=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
                       "rollout.max_new_tokens=8", "trainer.progress_bar=false", "eval.num_problems=2"])
    res = train(cfg)
    assert mlflow.MlflowClient(res.tracking_uri).get_run(res.mlflow_run_id).info.status == "FINISHED"


def test_inspect_shows_turns(tmp_path, tool_model_dir):
    """`gearlab inspect` on the tool task: every assigner incl. the turn methods, turn ids, per-turn
    rewards and end reasons in the JSON, turn markers in the HTML."""
    import json

    from gearlab import credit
    from gearlab.commands.inspect import inspect

    cfg = load_config(["task=tool_arith", f"model.name_or_path={tool_model_dir}", f"trainer.output_dir={tmp_path}",
                       f"inspect.out_dir={tmp_path / 'insp'}", "inspect.prompts=2", "rollout.group_size=2",
                       "rollout.max_new_tokens=32", "inspect.assigners=[grpo,mt_grpo,gigpo,gear]"])
    inspect(cfg)
    rec = json.loads((tmp_path / "insp" / "credit.json").read_text())
    assert rec["assigners"] == ["grpo", "mt_grpo", "gigpo", "gear"]
    multi = [s for s in rec["samples"] if len(s["turn_rewards"]) > 1]
    assert multi, "the warm-started model should make at least one call"
    s = multi[0]
    assert s["end_reason"] in ("done", "max_turns", "token_budget", "turn_length", "env_error")
    assert sorted(set(s["turn_ids"])) == list(range(len(s["turn_rewards"])))
    assert 0 in s["response_mask"]  # the tool's answer is in the sequence, not generated
    for name in ("mt_grpo", "gigpo", "gear"):
        assert all(v == 0 for v, m in zip(s["credit"][name], s["response_mask"]) if not m)
    html = (tmp_path / "insp" / "credit.html").read_text()
    assert "┃1" in html and "turn rewards" in html
    assert credit.get("mt_grpo").requires_turns


def test_paired_comparison_on_the_tool_task(tmp_path, tool_model_dir):
    """`gearlab compare` on the multi-turn task: the paired design holds (same prompts and first rollouts
    across methods) and the report adds the tool-use table."""
    from gearlab.commands.compare import compare

    base = ["task=tool_arith", f"model.name_or_path={tool_model_dir}", f"trainer.output_dir={tmp_path}",
            "trainer.max_steps=2", "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=32",
            "eval.num_problems=4", "eval.k=2", "trainer.progress_bar=false"]
    cfg = load_config([*base, "compare.name=tools", "compare.assigners=[grpo,mt_grpo,gigpo]", "compare.seeds=[0]"])
    out = compare(cfg, base)
    assert out["failed"] == []
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("compare/tools")
    kids = {r.data.tags["assigner"]: r for r in client.search_runs([exp.experiment_id]) if "assigner" in r.data.tags}
    first = {a: client.get_metric_history(r.info.run_id, "rollout/tool_call_frac") for a, r in kids.items()}
    assert len({sorted(h, key=lambda m: m.step)[0].value for h in first.values()}) == 1  # same first rollouts
    assert "called a tool (final greedy)" in out["table"] and "| mt_grpo" in out["table"]  # the table the CLI prints


@pytest.mark.parametrize("engine", [[], ["rollout.engine=fast"],
                                    ["rollout.engine=fast", "rollout.fast.sharded_weights=replica"]],
                         ids=["hf", "fast-gather", "fast-replica"])
def test_multi_turn_training_on_two_fsdp2_processes(tmp_path, tool_model_dir, engine):
    """Ranks whose episodes end at different turns (and hold different numbers of rows per generate call:
    rollout.batch_size=3) keep their collectives in step: 2 gloo ranks train and evaluate the tool task, with HF
    generate and with the fast decoder (which gathers the shards at every call, or refreshes its replica once)."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    args = ["task=tool_arith", "assigner=mt_grpo", f"model.name_or_path={tool_model_dir}", "trainer.devices=2",
            "trainer.accelerator=cpu", "trainer.max_steps=2", "rollout.prompts_per_step=4", "rollout.group_size=3",
            "rollout.batch_size=3", "rollout.max_new_tokens=32", "eval.num_problems=5", "trainer.progress_bar=false",
            f"trainer.output_dir={tmp_path}", *engine]
    r = subprocess.run([sys.executable, "-m", "gearlab.cli", "train", *args], capture_output=True, text=True,
                       timeout=900, cwd=tmp_path, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    c = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = c.search_runs([c.get_experiment_by_name("gearlab").experiment_id])
    m = run.data.metrics
    assert run.info.status == "FINISHED" and m["train/iteration"] == 2
    assert m["rollout/tool_call_frac"] > 0 and m["rollout/turns_mean"] > 1
    assert sum(v for k, v in m.items() if k.startswith("rollout/end_")) == pytest.approx(1.0)
    assert "eval/greedy_tool_call_frac" in m and "eval/greedy_accuracy" in m
    final, start = load_file(str(tmp_path / "tool_arith-mt_grpo-s0" / "final" / "model.safetensors")), load_file(
        str(tool_model_dir / "model.safetensors"))
    assert any(not torch.equal(final[k], start[k]) for k in final)  # it trained
