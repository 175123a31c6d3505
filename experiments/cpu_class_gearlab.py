"""gearlab's own CPU path on this machine, reduced to digests to compare with another CPU class.

Runs, each as its own `gearlab` process with the kernels pinned (gearlab.cpu_kernels): a short warm start of the
embedded tiny model (60 SFT steps; the tokenizer trained offline, the model built from config), then 2 GRPO
iterations of GEAR from it (8 prompts × 4 samples, HF generate, teacher pass, fused AdamW). Prints one JSON line:
versions, CPU model, the SHA-256 of the tokenizer file, the warm start's weights and held-out accuracy, and the RL
run's final weights and logged metrics. Two machines with the same versions must print the same line except
``cpu_model`` and the timings.

    python experiments/cpu_class_gearlab.py [OUT_DIR]
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _gearlab(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "gearlab.cli", *args], check=True, capture_output=True, text=True)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="ccg-"))
    common = [f"trainer.output_dir={out}", "trainer.seed=0"]
    t0 = time.time()
    _gearlab("warmstart", *common, "warmstart.steps=60")
    t1 = time.time()
    _gearlab("train", *common, "assigner=gear", "trainer.max_steps=2", "trainer.threads=1",
             "rollout.prompts_per_step=8",
             "rollout.group_size=4", "eval.num_problems=16", "trainer.progress_bar=false", "trainer.run_name=ccg",
             "trainer.accelerator=cpu")
    t2 = time.time()

    import gearlab  # noqa: F401
    from gearlab.cpu_kernels import describe
    from gearlab.models.checkpoints import weights_digest
    from gearlab.trainer.provenance import package_versions

    ws = out / "embedded" / "tiny-arith"
    info = json.loads((ws / "warmstart.json").read_text())
    summary = json.loads((out / "ccg" / "summary.json").read_text())
    res = {
        "versions": {k: v for k, v in package_versions().items() if k not in ("gearlab",)},
        **describe(),
        "tokenizer_sha256": hashlib.sha256((ws / "tokenizer.json").read_bytes()).hexdigest()[:16],
        "start_sha256": info["weights_sha256"][:16],
        "start_acc": [info.get("acc_plain_greedy"), info.get("acc_plain_sampled"), info.get("acc_privileged_greedy")],
        "final_sha256": (weights_digest(out / "ccg" / "final") or "")[:16],
        "metrics": summary.get("metrics"),
        "seconds": [round(t1 - t0, 1), round(t2 - t1, 1)],
    }
    print(json.dumps(res, default=str))


if __name__ == "__main__":
    main()
