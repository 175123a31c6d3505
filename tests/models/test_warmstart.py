"""The main job's starting point and its first RL steps, pinned to exact digests.

Every number of the main job starts from the shipped warm start (gearlab.models.shipped) and follows from it through
RL. With the CPU kernels pinned (gearlab.cpu_kernels), both are bitwise the same on every x86-64 CPU class measured
(AMD EPYC, Intel Xeon): these tests fail on any machine, dependency set or code change that would print other
digits — the README's table must then be re-measured.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gearlab.config import load_config
from gearlab.models.checkpoints import weights_digest
from gearlab.models.shipped import SHIPPED_DIR, recipe, shipped_matches

ROOT = Path(__file__).resolve().parents[2]
# sha256 of the shipped warm start's weights (gearlab.models.checkpoints.weights_digest)
START_SHA256 = "22a248c5ea2789cc0e8a06041491ee948ab7032126f2fe70da5e13ca3f5f4265"
# the final weights after 2 GEAR iterations from it (RL_COMMAND below), and two of its logged values
RL_SHA256 = "2a2da688ce89012e22224327a1dbec53ba978018d4ad2a61605f110286252407"
RL_OVERRIDES = ["assigner=gear", "trainer.max_steps=2", "trainer.threads=1", "trainer.accelerator=cpu",
                "rollout.prompts_per_step=8", "rollout.group_size=4", "eval.num_problems=16",
                "trainer.progress_bar=false", "trainer.run_name=pinned"]


# a hang guard: the warm start's 600 SFT steps take ~240 s alone on 2 cores (marked serial: run alone)
def _gearlab(*args: str, timeout: int = 1200) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "gearlab.cli", *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_shipped_warm_start_is_the_pinned_one():
    assert weights_digest(SHIPPED_DIR) == START_SHA256
    info = json.loads((SHIPPED_DIR / "warmstart.json").read_text())
    assert info["weights_sha256"] == START_SHA256 and info["steps"] == 600 and info["threads"] == 2
    # the default recipe is the shipped one; any change to it means a real SFT run
    assert shipped_matches(load_config([]), "embedded:tiny-arith")
    assert shipped_matches(load_config(["experiment=embedded"]), "embedded:tiny-arith")
    for change in ("trainer.seed=1", "warmstart.steps=450", "warmstart.threads=1", "task.options.max_operand=8"):
        assert not shipped_matches(load_config([change]), "embedded:tiny-arith"), change
    assert recipe(load_config([]), "embedded:tiny-arith")["lr"] == 3e-3


def test_readme_states_the_shipped_accuracy():
    info = json.loads((SHIPPED_DIR / "warmstart.json").read_text())
    readme = (ROOT / "README.md").read_text()
    found = re.findall(r"\*\*([0-9.]+)%\*\*\s+greedy", readme)
    assert found and float(found[0]) == round(100 * info["acc_plain_greedy"], 1), found


def test_the_default_recipe_copies_the_shipped_files(tmp_path):
    from gearlab.models.loading import embedded_dir, run_warmstart

    cfg = load_config([f"trainer.output_dir={tmp_path}"])
    res = run_warmstart(cfg)
    assert res["weights_sha256"] == START_SHA256
    assert weights_digest(embedded_dir(cfg, "embedded:tiny-arith")) == START_SHA256
    assert not (embedded_dir(cfg, "embedded:tiny-arith") / "recipe.json").exists()


@pytest.mark.slow
@pytest.mark.serial
def test_gearlab_warmstart_recomputes_the_shipped_weights(tmp_path):
    _gearlab("warmstart", f"trainer.output_dir={tmp_path}")
    res = json.loads((tmp_path / "embedded" / "tiny-arith" / "warmstart.json").read_text())
    shipped = json.loads((SHIPPED_DIR / "warmstart.json").read_text())
    assert res["weights_sha256"] == START_SHA256, (
        "`gearlab warmstart` no longer writes the shipped weights: dependencies, kernels or code moved the warm "
        "start; re-make gearlab/models/data/tiny-arith and re-measure the README's figures")
    for k in ("acc_plain_greedy", "acc_plain_sampled", "acc_privileged_greedy", "loss_last"):
        assert res[k] == shipped[k], k


@pytest.mark.slow
def test_two_rl_iterations_give_the_pinned_weights(tmp_path):
    _gearlab("train", f"trainer.output_dir={tmp_path}", *RL_OVERRIDES)
    digest = weights_digest(tmp_path / "pinned" / "final")
    summary = json.loads((tmp_path / "pinned" / "summary.json").read_text())["metrics"]
    assert summary["train/iteration"] == 2
    assert digest == RL_SHA256, f"2 GEAR iterations from the shipped start now end at {digest}"


def test_gearlab_warmstart_fine_tunes_a_pretrained_model_on_the_tasks_demonstrations(tmp_path, tiny_model_dir):
    """A model folder (not an embedded tiny one) is fine-tuned, not replaced: `gearlab warmstart` SFTs it on the
    task's worked solutions into runs/warmstart/<folder>-<task> and says where."""
    from safetensors.torch import load_file

    out = _gearlab("warmstart", f"model.name_or_path={tiny_model_dir}", "task=rg", "task.options.dataset=chain_sum",
                   "warmstart.steps=3", "warmstart.batch_size=4", "warmstart.lr=1e-3", "warmstart.n_eval=2",
                   "rollout.max_new_tokens=8", f"trainer.output_dir={tmp_path}")
    dest = tmp_path / "warmstart" / f"{tiny_model_dir.name}-rg"
    assert f"warm-started model: {dest}" in out.stdout
    res = json.loads((dest / "warmstart.json").read_text())
    assert res["task"] == "rg" and res["steps"] == 3 and res["n_eval"] == 2 and res["model_dir"] == str(tiny_model_dir)
    before, after = load_file(str(tiny_model_dir / "model.safetensors")), load_file(str(dest / "model.safetensors"))
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)


def test_a_cuda_warm_start_runs_deterministic_kernels_and_math_attention_then_restores_them():
    """The GPU warm start must be the same bits on every machine of one card kind (compare checks its digest): cuDNN
    attention's backward made two SmolLM2 warm starts on two H200s differ. The flags are process-wide, so the test
    needs no GPU; on the CPU the context changes nothing (the CPU kernels are pinned elsewhere)."""
    from torch.backends import cuda as cb

    from gearlab.models.warmstart import warmstart_kernels

    def state():
        return (torch.are_deterministic_algorithms_enabled(), cb.math_sdp_enabled(), cb.flash_sdp_enabled(),
                cb.mem_efficient_sdp_enabled(), cb.cudnn_sdp_enabled())

    before = state()
    assert before[0] is False and before[2] is True  # the defaults this test starts from
    with warmstart_kernels(torch.device("cpu")):
        assert state() == before
    with warmstart_kernels(torch.device("cuda")):
        assert state() == (True, True, False, False, False)
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert state() == before
