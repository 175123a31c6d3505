"""``gearlab replay``: one cached set of rollouts through several assigners (no training).

The rollout file (``replay.rollouts``, a ``torch.save`` of plain tensors, lists and strings) is made
on first use from the configured model and task, and can be kept and shared: replaying it again —
on another machine, with other assigners — credits exactly the same tokens. What is logged (to
MLflow, experiment ``replay``, and ``<rollouts>.replay.json``):
  rank_corr/<a>__<b>    Spearman correlation of |token weight| between two methods, over generated tokens
                        of sequences with A_i ≠ 0 (weight = A_{i,t} / A_i: the method's redistribution)
  sign_diff_vs_grpo/<a> fraction of generated tokens whose advantage sign differs from GRPO's
  top10_share/<a>       share of total |advantage| carried by the top 10% of tokens (concentration)
  gear_segment_pos      histogram (10 bins) of where GEAR segment tokens fall, relative position in the response
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gearlab.core.batch import RolloutBatch
from gearlab.config import Config
from gearlab.rollout.base import SamplingParams
from gearlab.rollout.factory import engine_from_config
from gearlab.tasks.base import Problem
from gearlab.tasks.registry import task_from_config

FORMAT = "gearlab-rollouts-v1"


def save_rollouts(path: Path, rb: RolloutBatch, problems: list[Problem], info: dict[str, Any]) -> None:
    tensors = {k: v.cpu() for k, v in vars(rb).items() if isinstance(v, Tensor)}
    torch.save({"format": FORMAT, "tensors": tensors, "meta": rb.meta, "info": info,
                "problems": [{"prompt": p.prompt, "answer": p.answer, "solution": p.solution, "meta": _plain(p.meta)}
                             for p in problems]}, path)


def _plain(meta: dict[str, Any]) -> dict[str, Any]:
    """The problem's meta as plain data (what ``torch.load(weights_only=True)`` reads back: the operands a task
    needs to locate errors); values that are not plain data are dropped."""
    import json

    out = {}
    for k, v in meta.items():
        try:
            out[k] = json.loads(json.dumps(v))
        except (TypeError, ValueError):
            continue
    return out


def load_rollouts(path: Path) -> tuple[RolloutBatch, list[Problem], dict[str, Any]]:
    data = torch.load(path, map_location="cpu", weights_only=True)
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a gearlab rollout file (format {data.get('format')!r}, expected {FORMAT!r})")
    rb = RolloutBatch(**data["tensors"], meta=data["meta"])
    return rb, [Problem(**p) for p in data["problems"]], data["info"]


def _spearman(a: Tensor, b: Tensor) -> float:
    """Spearman's rho with average ranks for ties; NaN when either side is constant (undefined)."""
    if a.numel() < 3 or a.unique().numel() < 2 or b.unique().numel() < 2:
        return float("nan")
    from scipy.stats import spearmanr

    return float(spearmanr(a.double().numpy(), b.double().numpy()).statistic)


def credit_stats(
    rb: RolloutBatch, seq_adv: Tensor, credit_by: dict[str, Tensor], segments: dict[str, Tensor]
) -> dict[str, float]:
    """The replay metrics (see the module docstring) for credit maps [B, T] of several methods on one batch."""
    m = rb.response_mask
    active = m & (seq_adv != 0)[:, None]
    out: dict[str, float] = {}
    weights = {a: (c / seq_adv.clamp(min=1e-12).where(seq_adv > 0, seq_adv.clamp(max=-1e-12))[:, None])[active]
               for a, c in credit_by.items()}
    names = sorted(credit_by)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            out[f"rank_corr/{a}__{b}"] = _spearman(weights[a].abs(), weights[b].abs())
    if "grpo" in credit_by:
        for a in names:
            if a != "grpo":
                # opposite signs; 0 is not a flip
                diff = (torch.sign(credit_by[a]) * torch.sign(credit_by["grpo"]) < 0) & m
                out[f"sign_diff_vs_grpo/{a}"] = float(diff.sum() / m.sum().clamp(min=1))
    for a in names:
        v = credit_by[a][m].abs().sort(descending=True).values
        k = max(1, int(0.1 * v.numel()))
        out[f"top10_share/{a}"] = float(v[:k].sum() / v.sum()) if v.sum() > 0 else float("nan")
    if "gear" in segments:
        seg = segments["gear"]
        pos = (m.long().cumsum(-1) - 1).float() / m.sum(-1, keepdim=True).clamp(min=1).float()
        hist = torch.histc(pos[(seg >= 0) & m], bins=10, min=0, max=1)
        for j, h in enumerate(hist.tolist()):
            out[f"gear_segment_pos/bin{j}"] = h / max(1.0, float(hist.sum()))
    return out


def cached_rollouts(cfg: Config, model: Any, engine: Any, task: Any, path: Path | None, prompts: int,
                    model_name: str) -> tuple[RolloutBatch, list[Problem], dict[str, Any]]:
    """(batch, problems, info) from the rollout file ``path`` when it exists, else ``prompts`` test problems ×
    ``rollout.group_size`` responses sampled from ``model`` (seed ``trainer.seed``) and written to ``path`` (when
    given). ``info["group_size"]`` is the file's group size."""
    if path is not None and path.is_file():
        return load_rollouts(path)
    problems = task.problems("test", prompts, cfg.trainer.seed)
    sampling = SamplingParams.of_rollout(cfg.rollout)
    was_training = model.training
    model.eval()
    try:
        rb = engine.generate(
            model, problems, group_size=cfg.rollout.group_size, sampling=sampling, seed=cfg.trainer.seed
        )
    finally:
        model.train(was_training)
    info = {"model": model_name, "task": cfg.task.name, "group_size": cfg.rollout.group_size, "seed": cfg.trainer.seed,
            "temperature": cfg.rollout.temperature}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_rollouts(path, rb, problems, info)
    return rb, problems, info


def replay(cfg: Config) -> dict[str, Any]:
    from gearlab.models.loading import load_for_evaluation
    from gearlab.commands.inspect import applicable_methods, run_assigners
    from gearlab.trainer.tracking import ensure_experiment, tracking_uri

    task = task_from_config(cfg)
    path = Path(cfg.replay.rollouts)
    model, tok, model_name = load_for_evaluation(cfg)
    engine = engine_from_config(tok, task, cfg, model=model)
    rb, problems, info = cached_rollouts(cfg, model, engine, task, path, cfg.replay.prompts, model_name)
    G = int(info["group_size"])
    names = applicable_methods(task, list(cfg.replay.assigners), "replay.assigners")
    res = run_assigners(rb, names, model=model, tokenizer=tok, engine=engine, problems=problems, group_size=G,
                        sampling=SamplingParams.of_rollout(cfg.rollout), temperature=cfg.rollout.temperature,
                        chunk_size=cfg.signals.chunk_size,
                        micro_batch_size=cfg.algorithm.micro_batch_size, seed=cfg.trainer.seed, task=task)
    stats = credit_stats(rb, res["seq_adv"], res["credit"], res["segments"])
    import mlflow

    from gearlab.core.metrics import sanitize_metric_key

    client = mlflow.MlflowClient(tracking_uri(cfg))
    exp_id = ensure_experiment(tracking_uri(cfg), "replay", client)
    run = client.create_run(exp_id, run_name=path.stem, tags={"rollouts": str(path.resolve()), "model": model_name,
                                                              "task": cfg.task.name, "assigners": ",".join(names)})
    for k, v in stats.items():
        if v == v:  # skip NaN (undefined for this batch)
            client.log_metric(run.info.run_id, sanitize_metric_key(k), v)
    out_json = path.with_suffix(".replay.json")
    out_json.write_text(
        json.dumps({"rollouts": str(path), "info": info, "assigners": names, "metrics": stats}, indent=2)
    )
    client.log_artifact(run.info.run_id, str(out_json))
    client.set_terminated(run.info.run_id)
    return {"rollouts": str(path), "sequences": rb.batch_size, "assigners": ", ".join(names),
            "metrics": str(out_json), "mlflow_run": run.info.run_id}
