"""Evaluation of a policy during and after training: greedy accuracy, avg@k and unbiased pass@k on the task's test
split (held out, unless the task has none: ``Task.held_out`` False, then the training problems), split across ranks in
a multi-process run."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from gearlab.config import Config
from gearlab.core.metrics import pass_at_k
from gearlab.rollout.base import SamplingParams
from gearlab.rollout.factory import engine_from_config


def eval_seed(cfg: Config) -> int:
    """The evaluation's problem / sampling seed: ``eval.seed``, or ``trainer.seed`` when it is -1."""
    return cfg.trainer.seed if cfg.eval.seed < 0 else cfg.eval.seed


def start_cache_key(cfg: Config, model_dir: str | Path) -> str | None:
    """A key for the evaluation of the weights in ``model_dir`` under this config's task, rollout and eval settings
    (file names, sizes and modification times of the folder's weights stand for the weights); None when the model
    is not a local folder."""
    d = Path(model_dir)
    if not (d / "config.json").is_file():
        return None
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in d.iterdir()
                   if p.suffix in (".safetensors", ".bin", ".json"))
    from omegaconf import OmegaConf

    parts = {"files": files, "task": OmegaConf.to_container(cfg.task), "rollout": OmegaConf.to_container(cfg.rollout),
             "eval": {k: v for k, v in OmegaConf.to_container(cfg.eval).items() if k not in ("checkpoint",
             "cache_start")},
             "seed": eval_seed(cfg), "dtype": cfg.model.dtype, "threads": torch.get_num_threads(),
             "precision": cfg.trainer.precision, "torch": torch.__version__,
             "autocast": True}  # evaluations under bf16-mixed / 16-mixed decode in autocast (older entries: fp32)
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def precision_context(cfg: Config, device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast as Lightning runs the training step under ``trainer.precision`` (bf16-mixed: bfloat16, 16-mixed:
    float16), else nothing: an evaluation decodes in the precision the rollouts of its run decode in, not in the
    fp32 of the master weights (on a GPU ~10x slower, and other numerics than the training's samples)."""
    p = str(cfg.trainer.precision)
    if p in ("bf16-mixed", "16-mixed"):
        return torch.autocast(device.type, dtype=torch.bfloat16 if p == "bf16-mixed" else torch.float16)
    return contextlib.nullcontext()


def cached_start_evaluation(model, tok, task, cfg: Config, model_dir: str | Path, engine: Any = None
                            ) -> dict[str, Any]:
    """``evaluate_model`` of the starting weights, read from ``<output_dir>/.eval_cache/<key>.json`` when the same
    weights were evaluated with the same settings before (every child of a comparison starts from one checkpoint;
    with a fixed ``eval.seed`` they share this evaluation exactly), else computed and stored."""
    key = start_cache_key(cfg, model_dir) if cfg.eval.cache_start else None
    path = Path(cfg.trainer.output_dir) / ".eval_cache" / f"{key}.json"
    if key is not None and path.is_file():
        try:
            return {**json.loads(path.read_text()), "cached": True}
        except (OSError, ValueError):
            pass  # a broken cache entry is recomputed
    res = evaluate_model(model, tok, task, cfg, engine)
    if key is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(res))
        os.replace(tmp, path)  # atomic: two children computing it at once write the same values
    return res


@torch.no_grad()
def evaluate_model(model, tok, task, cfg: Config, engine: Any = None) -> dict[str, Any]:
    """Greedy accuracy (unless ``eval.greedy`` is off), avg@k and unbiased pass@k on ``eval.num_problems`` test
    problems, decoded in the run's precision (``precision_context``). ``engine``: a rollout engine made by
    ``engine_from_config`` for this task and config, to reuse (its compiled pieces and CUDA graphs) across the
    evaluations of a run; None = a new one.

    The problems and sampling seeds depend only on ``eval.seed`` (default: ``trainer.seed``) and the number of \
processes, so
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
    seed = eval_seed(cfg)
    problems = task.problems("test", cfg.eval.num_problems, seed)
    mine = problems[rank::world]
    # every rank decodes the same number of problems (their forward passes must stay in step): ranks
    # with one fewer repeat a problem at weight 0
    per = -(-len(problems) // world)
    weight = torch.tensor([1.0] * len(mine) + [0.0] * (per - len(mine)))
    mine = mine + problems[:1] * (per - len(mine))
    engine = engine or engine_from_config(tok, task, cfg, model=model)
    engine.synced_gpus = world > 1  # ranks decode different problems: keep their forward passes in step
    dev = next(model.parameters()).device
    t0 = time.time()
    k = cfg.eval.k
    greedy = None
    with gathered_for_generation(model), precision_context(cfg, dev):
        if cfg.eval.greedy:
            greedy = engine.generate(model, mine, group_size=1, seed=seed,
                                     sampling=SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, greedy=True))
        # sample j of global problem q draws with seed + 1 + q·k + j: the same samples on any number of ranks
        rows = [(rank + i * world) * k + j for i in range(per) for j in range(k)]
        sampled = engine.generate(model, mine, group_size=k, seed=(seed + 1 + torch.tensor(rows)) % (2**63 - 1),
                                  sampling=SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens,
                                                          temperature=cfg.eval.temperature, top_p=cfg.rollout.top_p,
                                                          top_k=cfg.rollout.top_k))
    correct = (sampled.rewards >= 1 - 1e-6).float().view(-1, k).sum(-1)
    values = {f"avg@{k}": correct / k, f"pass@{k}": pass_at_k(correct, k, k)}
    if greedy is not None:
        values["greedy_accuracy"] = (greedy.rewards >= 1 - 1e-6).float()
    out: dict[str, Any] = {"problems": len(problems)}
    for name, v in values.items():
        m = MeanMetric().to(dev)
        m.update(v.to(dev), weight=weight.to(dev))
        out[name] = float(m.compute())
    # multi-turn tasks: how the greedy episodes used their tools and ended (means over episodes; a padding
    # repeat, at most one per rank, is counted here)
    for n, v in (greedy.meta.get("rollout_stats", {}) if greedy is not None else {}).items():
        if n in ("tool_call_frac", "finish_frac", "valid_call_frac", "correct_call_frac", "turns_mean"):
            m = MeanMetric().to(dev)
            m.update(torch.tensor(float(v), device=dev), weight=torch.tensor(float(len(mine)), device=dev))
            out[f"greedy_{n}"] = float(m.compute())
    out["seconds"] = round(time.time() - t0, 2)
    return out
