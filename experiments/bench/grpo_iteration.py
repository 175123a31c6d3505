"""Time split of one GRPO iteration (rollout / signals+credit / update) on the embedded default.

Runs the real `gearlab train` path for a few iterations and reads the per-phase timings that the
module logs to MLflow (`time/*`), so what is measured is what users run. Prints the median of
each phase over the iterations after the first (warm-up) and writes a JSON/Markdown result.

    python experiments/bench/grpo_iteration.py                      # grpo, embedded tiny-arith
    python experiments/bench/grpo_iteration.py assigner=grpo rollout.group_size=8
"""
from __future__ import annotations

import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlflow
import torch

from gearlab.config import load_config
from gearlab.trainer.train import train

PHASES = ("rollout_s", "signals_credit_s", "update_s")


def main(argv: list[str]) -> None:
    iters = 6
    with tempfile.TemporaryDirectory() as tmp:
        base = [f"trainer.output_dir={tmp}", f"trainer.max_steps={iters}", "trainer.progress_bar=false",
                "trainer.checkpoint_every=1000"]
        # the warm-started model of `gearlab warmstart` run from this directory (made if missing)
        embedded = Path("runs/embedded/tiny-arith")
        if not embedded.is_dir():
            from gearlab.models.loading import run_warmstart

            run_warmstart(load_config(["trainer.output_dir=runs"]))
        base.append(f"model.name_or_path={embedded.resolve()}")
        cfg = load_config(base + argv)
        t0 = time.perf_counter()
        res = train(cfg)
        wall = time.perf_counter() - t0
        client = mlflow.MlflowClient(res.tracking_uri)
        per_phase = {}
        for p in PHASES:
            hist = sorted(client.get_metric_history(res.mlflow_run_id, f"time/{p}"), key=lambda m: m.step)
            per_phase[p] = statistics.median(m.value for m in hist[1:])
        toks = client.get_run(res.mlflow_run_id).data.metrics["train/generated_tokens_total"]
    total = sum(per_phase.values())
    result = {
        "machine": f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} torch threads".strip(),
        "torch": torch.__version__, "model": cfg.model.name_or_path.split("/")[-1],
        "sequences_per_iteration": cfg.rollout.prompts_per_step * cfg.rollout.group_size,
        "max_new_tokens": cfg.rollout.max_new_tokens, "iterations": iters, "wall_s_incl_startup": round(wall, 2),
        "median_s": {k: round(v, 3) for k, v in per_phase.items()}, "median_total_s": round(total, 3),
        "share": {k: round(v / total, 3) for k, v in per_phase.items()},
        "generated_tokens_per_iteration": toks / iters, "overrides": argv,
    }
    print(json.dumps(result, indent=2))
    print("\n| phase | median s | share |\n|---|---|---|")
    for k in PHASES:
        print(f"| {k[:-2]} | {per_phase[k]:.3f} | {per_phase[k] / total:.0%} |")


if __name__ == "__main__":
    main(sys.argv[1:])
