"""Sharded stop-and-resume through ``gearlab.trainer.train.train`` without MLflow, for GPU machines that lack it
(FSDP1 runs only on GPUs, so tests/parallel/test_fsdp_train.py cannot cover it in CI):

    python tests/parallel/resume_script.py OUT STRATEGY PHASE     # PHASE: init | full | stop | resume | compare

``full`` trains 3 iterations; ``stop`` trains 2 and stops (trainer.stop_after) with a sharded checkpoint;
``resume`` runs the same command again; ``compare`` prints the largest difference between the two final
models (run by experiments/bench/fsdp1_gpu.sh resume).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    out, strategy, phase = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    model_dir = out / "model"
    if phase == "init":
        from gearlab.models.tiny import build_tiny_model, build_tokenizer

        tok = build_tokenizer()
        build_tiny_model(tok, seed=0).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
        return
    if phase == "compare":
        from safetensors.torch import load_file

        a, b = (load_file(str(out / r / "arith-grpo-s0" / "final" / "model.safetensors")) for r in ("full", "stopped"))
        s = load_file(str(model_dir / "model.safetensors"))
        diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
        moved = max((a[k].float() - s[k].float()).abs().max().item() for k in a)
        print(
            f"{strategy}: stop+resume vs uninterrupted, max |Δw| = {diff:.3g} (training moved weights by up to "
            f"{moved:.3g})"
        )
        return
    import gearlab.trainer.train as T

    T.make_logger = lambda *a, **k: None  # the GPU image has no MLflow; checkpoints and resume are under test
    from gearlab.config import load_config

    run = "full" if phase == "full" else "stopped"
    cfg = load_config([f"model.name_or_path={model_dir}",
                       f"trainer.accelerator={os.environ.get('RESUME_ACCEL', 'gpu')}", "trainer.devices=2",
                       f"trainer.strategy={strategy}", "rollout.prompts_per_step=4", "rollout.group_size=4",
                       "rollout.max_new_tokens=8", "eval.num_problems=0", "trainer.progress_bar=false", "optim.lr=1e-3",
                       "algorithm.entropy_coef=0.05",
                       "trainer.max_steps=3", "trainer.checkpoint_every=1", f"trainer.output_dir={out / run}",
                       *(["trainer.stop_after=2"] if phase == "stop" else [])])
    T.train(cfg)


if __name__ == "__main__":
    main()
