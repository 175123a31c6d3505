"""Sharded ≡ single: one GRPO optimizer step on the same global batch gives the same loss and the same
full gradients on 1 process and on 2 processes (gloo) under FSDP2 and DDP, for every loss aggregation."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("parity_script.py")


def _run(tmp_path: Path, devices: int, strategy: str, agg: str, mbs: int, packed: bool = False, mb_tokens: int = 0,
         compiled: bool = False) -> dict:
    out = tmp_path / f"{devices}-{strategy}-{agg}-{mbs}-{packed}-{mb_tokens}-{compiled}.pt"
    extra = ["cpu", "packed"] if packed else []
    env = {**os.environ, "PARITY_MICRO_BATCH_TOKENS": str(mb_tokens), "PARITY_COMPILE": str(int(compiled))}
    r = subprocess.run([sys.executable, str(SCRIPT), str(out), str(devices), strategy, agg, str(mbs), *extra],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(out)


_REFERENCES: dict[str, dict] = {}


def _reference(tmp_path: Path, agg: str) -> dict:
    """The whole batch in one micro-batch on one process, run once per aggregation for every test of the module."""
    if agg not in _REFERENCES:
        _REFERENCES[agg] = _run(tmp_path, 1, "auto", agg, 8)
    return _REFERENCES[agg]


@pytest.mark.parametrize("agg,strategies", [("token-mean", ["fsdp2", "ddp"]), ("seq-mean-token-mean", ["fsdp2"]),
                                            ("seq-mean-token-sum-norm", ["fsdp2"])])
def test_two_processes_match_one(tmp_path, agg, strategies):
    ref = _reference(tmp_path, agg)
    for strategy in strategies:
        got = _run(tmp_path, 2, strategy, agg, 3)  # 4 rows per rank in micro-batches of 3 and 1
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), strategy
        assert got["grads"].keys() == ref["grads"].keys()
        for k, g in ref["grads"].items():
            torch.testing.assert_close(got["grads"][k], g, rtol=1e-4, atol=1e-7, msg=f"{strategy} {agg} {k}")
        assert sum(g.abs().sum() for g in ref["grads"].values()) > 0


def test_packed_two_processes_match_padded_one(tmp_path):
    """Packed (padding-free) micro-batches on 2 FSDP2 ranks, split by a 20-token budget (3 micro-batches on
    rank 0, 2 on rank 1, padded with an empty one) ≡ the padded batch in one micro-batch on one process."""
    ref = _reference(tmp_path, "token-mean")
    got = _run(tmp_path, 2, "fsdp2", "token-mean", 8, packed=True, mb_tokens=20)
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    for k, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][k], g, rtol=1e-4, atol=1e-7, msg=k)


def test_compiled_two_processes_match_eager_one(tmp_path):
    """trainer.compile=true under FSDP2 on 2 ranks (compiled layers inside fully_shard's hooks, compiled head
    chunks) ≡ the eager model on one process."""
    ref = _reference(tmp_path, "token-mean")
    got = _run(tmp_path, 2, "fsdp2", "token-mean", 3, compiled=True)
    assert got["dynamo_frames"] > 0 and ref["dynamo_frames"] == 0  # the compiled path ran (and only there)
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    for k, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][k], g, rtol=1e-4, atol=1e-7, msg=k)


_EXIT_PROBE = """
import atexit, sys, torch.distributed as dist
from gearlab.config import load_config
from gearlab.parallel.distributed import make_strategy
atexit.register(lambda: open(sys.argv[1], "w").write(str(dist.is_initialized())))  # runs last (atexit is LIFO)
dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + ".store", rank=0, world_size=1)
make_strategy(load_config(["trainer.devices=2", "trainer.strategy=ddp", "trainer.accelerator=cpu"]))
"""


def test_a_multi_process_strategy_tears_the_process_group_down_before_interpreter_exit(tmp_path):
    """Gloo left to interpreter finalisation can abort a finished rank (SIGABRT); the strategy's exit hook destroys
    the group while the interpreter is whole."""
    probe = tmp_path / "alive"
    r = subprocess.run([sys.executable, "-c", _EXIT_PROBE, str(probe)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert probe.read_text() == "False"
