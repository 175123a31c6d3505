"""Held-out evaluation of a policy during and after training: greedy accuracy, avg@k and unbiased pass@k on the
task's test split, split across ranks in a multi-process run."""
from __future__ import annotations

import time
from typing import Any

import torch

from gearlab.config import Config
from gearlab.core.metrics import pass_at_k
from gearlab.rollout.base import SamplingParams
from gearlab.rollout.factory import engine_from_config


@torch.no_grad()
def evaluate_model(model, tok, task, cfg: Config) -> dict[str, Any]:
    """Greedy accuracy, avg@k and unbiased pass@k on ``eval.num_problems`` test problems.

    The problems and sampling seeds depend only on ``trainer.seed`` (and the number of processes), so
    every run of a paired comparison is evaluated on the same problems with the same random numbers.
    In a multi-process run each rank evaluates every world-th problem and the means are aggregated across
    ranks with torchmetrics (weighted by counts: the same numbers as one process on all problems, up to
    the sampling stream, which depends on the batch).
    """
    from torchmetrics import MeanMetric

    from gearlab.parallel.distributed import gathered_for_generation

    world, rank = 1, 0
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    problems = task.problems("test", cfg.eval.num_problems, cfg.trainer.seed)
    mine = problems[rank::world]
    # every rank decodes the same number of problems (their forward passes must stay in step): ranks
    # with one fewer repeat a problem at weight 0
    per = -(-len(problems) // world)
    weight = torch.tensor([1.0] * len(mine) + [0.0] * (per - len(mine)))
    mine = mine + problems[:1] * (per - len(mine))
    engine = engine_from_config(tok, task, cfg)
    engine.synced_gpus = world > 1  # ranks decode different problems: keep their forward passes in step
    dev = next(model.parameters()).device
    t0 = time.time()
    k = cfg.eval.k
    with gathered_for_generation(model):
        greedy = engine.generate(model, mine, group_size=1, seed=cfg.trainer.seed,
                                 sampling=SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, greedy=True))
        sampled = engine.generate(model, mine, group_size=k, seed=cfg.trainer.seed + 1 + 7919 * rank,
                                  sampling=SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens,
                                                          temperature=cfg.eval.temperature, top_p=cfg.rollout.top_p,
                                                          top_k=cfg.rollout.top_k))
    correct = (sampled.rewards >= 1 - 1e-6).float().view(-1, k).sum(-1)
    values = {"greedy_accuracy": (greedy.rewards >= 1 - 1e-6).float(), f"avg@{k}": correct / k,
              f"pass@{k}": pass_at_k(correct, k, k)}
    out: dict[str, Any] = {"problems": len(problems)}
    for name, v in values.items():
        m = MeanMetric().to(dev)
        m.update(v.to(dev), weight=weight.to(dev))
        out[name] = float(m.compute())
    # multi-turn tasks: how the greedy episodes used their tools and ended (means over episodes; a padding
    # repeat, at most one per rank, is counted here)
    for n, v in greedy.meta.get("rollout_stats", {}).items():
        if n in ("tool_call_frac", "finish_frac", "valid_call_frac", "correct_call_frac", "turns_mean"):
            m = MeanMetric().to(dev)
            m.update(torch.tensor(float(v), device=dev), weight=torch.tensor(float(len(mine)), device=dev))
            out[f"greedy_{n}"] = float(m.compute())
    out["seconds"] = round(time.time() - t0, 2)
    return out
