"""The embedded tiny model's warm start, shipped inside the package so the main job does not have to redo it.

``gearlab warmstart`` with the default recipe (task ``arith``, seed 0, 600 SFT steps of 32, lr 3e-3, 2 threads,
CPU, fp32) writes exactly these files on any x86-64 CPU with the lock's torch (the kernels are pinned and oneDNN's
version is part of the digits, gearlab.cpu_kernels;
``tests/models/test_warmstart.py`` re-runs it and compares the weights digest). Copying them takes a second where
the SFT takes minutes, so ``embedded:tiny-arith`` with that recipe is copied, not recomputed. Any other recipe
(another seed, task option, step count, ``warmstart.*`` value) runs the SFT as before.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

__all__ = ["SHIPPED_DIR", "RECIPE_FILE", "recipe", "shipped_matches", "copy_shipped"]

SHIPPED_DIR = Path(__file__).resolve().parent / "data" / "tiny-arith"
RECIPE_FILE = "recipe.json"


def recipe(cfg: Any, ref: str) -> dict[str, Any]:
    """What decides the warm start's weights for model ``ref`` under config ``cfg`` (a plain JSON-able dict)."""
    from omegaconf import OmegaConf

    w = cfg.warmstart
    options = cfg.task.options
    options = OmegaConf.to_container(options) if OmegaConf.is_config(options) else dict(options or {})
    return {"model": ref, "task": cfg.task.name, "task_options": options, "seed": int(cfg.trainer.seed),
            "steps": int(w.steps), "batch_size": int(w.batch_size), "lr": float(w.lr), "threads": int(w.threads),
            "max_minutes": w.max_minutes, "device": w.device, "bf16": bool(w.bf16)}


def shipped_matches(cfg: Any, ref: str) -> bool:
    """Whether the shipped warm start is the one ``gearlab warmstart`` would make for ``ref`` under ``cfg``."""
    f = SHIPPED_DIR / RECIPE_FILE
    if not f.is_file():
        return False
    return json.loads(f.read_text()) == recipe(cfg, ref)


def copy_shipped(dest: str | Path) -> dict[str, Any]:
    """Copy the shipped warm start into ``dest`` (made if missing); returns its ``warmstart.json`` record."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for f in SHIPPED_DIR.iterdir():
        if f.is_file() and f.name != RECIPE_FILE:
            # each file whole or not at all: the ranks of a multi-process launch copy at the same time, and one may
            # read a file while another rewrites it (a copy under a unique name, then an atomic rename)
            tmp = dest / f".{f.name}.{uuid.uuid4().hex}.tmp"
            shutil.copy2(f, tmp)
            os.replace(tmp, dest / f.name)
    return json.loads((dest / "warmstart.json").read_text())
