"""Every shipped experiment preset loads, validates and passes the start-up checks (no weights loaded):
a recipe that cannot start is caught here, not on a cluster."""
from __future__ import annotations

import pytest

from gearlab.parallel import distributed
from gearlab.config import ConfigError, conf_dir, load_config
from gearlab.trainer.preflight import preflight

PRESETS = sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml"))
MATH_TASKS = ("gsm8k", "math", "math500", "aime")  # these need task.options.path (gearlab.tasks.math)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_starts(name):
    cfg = load_config([f"experiment={name}"])
    if cfg.task.name in MATH_TASKS and not cfg.task.options.get("path"):
        # a maths preset names no data file (its header says which key to set): it refuses to start, rather than
        # train on the shipped test sample; the sample, asked for explicitly, stands in for the data here
        with pytest.raises(ConfigError, match=r"^key 'task.options.path': no data file given"):
            preflight(cfg)
        cfg = load_config([f"experiment={name}", "task.options.path=sample"])
    distributed.check(cfg)
    task, assigner = preflight(cfg)
    assert task.problems("train", 2) and task.problems("test", 1)


def test_qwen3_recipes_shard_over_their_nodes():
    for name, nodes in (
        ("qwen3_4b_math", 1), ("qwen3_4b_math_2node", 2), ("qwen3_8b_math", 1), ("qwen3_8b_math_2node", 2)
    ):
        cfg = load_config([f"experiment={name}"])
        assert distributed.strategy_name(cfg) == "fsdp2" and cfg.trainer.num_nodes == nodes and cfg.trainer.devices == 8
        assert cfg.model.dtype == "float32" and cfg.trainer.precision == "bf16-mixed"  # fp32 master, bf16 compute


def test_the_benchmarks_timing_hook_reads_what_the_trainer_logs(tmp_path):
    """experiments/bench times iterations by overriding GRPOModule._log_iteration: it must take the trainer's
    arguments and find the update's metrics, last (a changed signature silently broke every GPU benchmark once)."""
    import inspect
    import json
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    import torch

    from gearlab.trainer.module import GRPOModule

    bench = Path(__file__).resolve().parents[1] / "experiments" / "bench"
    sys.path.insert(0, str(bench))
    try:
        from engines_table import table
        from trl_vs_gearlab import scaled_micro, timed_module
    finally:
        sys.path.remove(str(bench))
    # the reasoning-length runs shrink every variant's micro-batch alike (64 at 2,048 tokens ran out of memory)
    assert [scaled_micro(64, n) for n in (128, 256, 1024, 2048)] == [64, 64, 16, 8] and scaled_micro(8, 2048) == 8
    assert list(inspect.signature(GRPOModule._log_iteration).parameters)[-1] == "upd"
    times: list[dict] = []
    hook = timed_module(GRPOModule, times)._log_iteration
    n_args = len(inspect.signature(GRPOModule._log_iteration).parameters) - 2  # without self and rb
    upd = {"time_rollout_s": 1.5, "time_signals_credit_s": 0.5, "time_update_s": 2.0, "fast/steps": 7}
    rb = SimpleNamespace(response_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]))
    hook(None, rb, *[None] * (n_args - 1), upd)
    assert times[0]["time_update_s"] == 2.0 and times[0]["fast/steps"] == 7.0 and times[0]["response_len"] == 2.5
    (tmp_path / "4b_d2_fast.json").write_text(json.dumps(
        {"shape": "qwen3-4b", "devices": 2, "engine": "fast", "sharded_weights": "gather", "s_per_iter": 6.5,
         "rollout_s": 2.0, "signals_credit_s": 1.5, "update_s": 3.0, "peak_mem_gib_rank0": 41.0,
         "engine_stats": {"fast/ms_per_step": 7.25}, "device": "NVIDIA H200", "s_per_iter_all": [30.0, 7.0, 6.5, 6.0],
         "warmup_iters": 1, "overrides": ["trainer.compile=true"]}))
    row = ("| 4b_d2_fast | qwen3-4b | 2 | fast (gather) | `trainer.compile=true` | 2–4 | 6.50 | 2.00 | 1.50 | 3.00 | "
           "7.25 | – | – | – | 41.0 |")
    assert row in table([tmp_path]).splitlines() and "Card: NVIDIA H200." in table([tmp_path])


def test_a_benchmark_variant_over_its_time_limit_is_stopped_with_its_children(tmp_path):
    """trl_vs_gearlab.run_child: a variant past --variant-timeout is recorded as stopped and its whole process group
    (torch.compile's workers) killed, so the next variant runs alone; a finished one returns its result file."""
    import json
    import os
    import sys
    import time
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "experiments" / "bench"
    sys.path.insert(0, str(bench))
    try:
        from trl_vs_gearlab import run_child
    finally:
        sys.path.remove(str(bench))
    pid_file, part = tmp_path / "grandchild.pid", tmp_path / "part.json"
    hang = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            f" open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    t0 = time.monotonic()
    assert run_child([sys.executable, "-c", hang], part, 3) == {"error": "stopped after 3 s (--variant-timeout)"}
    assert time.monotonic() - t0 < 20
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # the killed grandchild is reaped by init; until then it may linger as a zombie
        try:
            os.kill(grandchild, 0)
            state = Path(f"/proc/{grandchild}/stat").read_text().split()[2]
        except (ProcessLookupError, FileNotFoundError):
            break
        if state == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the variant's own child survived its time limit")
    write = f"import json; open({str(part)!r}, 'w').write(json.dumps({{'s_per_iter': 1.25}}))"
    assert run_child([sys.executable, "-c", write], part, 30) == {"s_per_iter": 1.25}
    failed = run_child([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "none.json", 0)
    assert failed == {"error": "exit code 3"}
    assert json.loads(part.read_text()) == {"s_per_iter": 1.25}
