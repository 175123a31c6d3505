"""A non-finite loss on ONE rank of two: every rank skips that optimizer step together (one all-reduced flag), the skip
is counted once, and the run neither hangs (the other rank's FSDP collectives still pair up) nor diverges; past
``trainer.max_nonfinite`` such steps in a row, both ranks stop with the same error."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

NAN_ON_RANK_1 = '''
import torch
import torch.distributed as dist
from gearlab.credit import CreditAssigner, CreditOutput, register

@register("nan_rank1")
class NanOnRankOne(CreditAssigner):
    """GRPO's credit, but NaN on rank 1 in the first ``bad`` iterations (``bad`` from the environment)."""
    def setup(self, *, seed, total_steps, task):
        self.calls = 0

    def assign(self, batch, seq_advantages, signals):
        import os
        adv = seq_advantages[:, None].float() * batch.response_mask.float()
        self.calls += 1
        if dist.is_initialized() and dist.get_rank() == 1 and self.calls <= int(os.environ["NAN_ITERATIONS"]):
            adv = adv + float("nan")
        return CreditOutput(token_advantages=adv)
'''


def _train(tmp_path, bad: int, *extra: str) -> subprocess.CompletedProcess:
    plug = tmp_path / "nan_rank1.py"
    plug.write_text(NAN_ON_RANK_1)
    args = ["trainer.accelerator=cpu", "trainer.devices=2", "trainer.threads=1", "rollout.prompts_per_step=4",
            "rollout.group_size=4", "trainer.max_steps=3", "eval.num_problems=0", "trainer.progress_bar=false",
            f"assigner.plugins=[{plug}]", "assigner=nan_rank1", f"trainer.output_dir={tmp_path}",
            "trainer.run_name=nan", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NAN_ITERATIONS": str(bad)}
    # a hang would be a timeout here, not a pass
    return subprocess.run([sys.executable, "-m", "gearlab.cli", "train", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)


@pytest.mark.slow
def test_nan_on_one_rank_skips_the_step_on_both_and_counts_it_once(tmp_path):
    r = _train(tmp_path, 1)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "nan" / "summary.json").read_text())["metrics"]
    assert summary["train/nonfinite_steps_total"] == 1 and summary["train/iteration"] == 3
    from safetensors.torch import load_file

    final = load_file(str(tmp_path / "nan" / "final" / "model.safetensors"))
    start = load_file(str(tmp_path / "embedded" / "tiny-arith" / "model.safetensors"))
    assert all(torch.isfinite(v).all() for v in final.values())
    assert any(not torch.equal(final[k], start[k]) for k in final)  # the two later iterations trained


@pytest.mark.slow
def test_nonfinite_steps_past_the_limit_stop_both_ranks(tmp_path):
    r = _train(tmp_path, 99, "trainer.max_nonfinite=2")
    assert r.returncode != 0
    assert "2 consecutive optimizer steps had a non-finite loss" in r.stderr, r.stderr[-3000:]
