"""Every shipped experiment preset loads, validates and passes the start-up checks (no weights loaded):
a recipe that cannot start is caught here, not on a cluster."""
from __future__ import annotations

import pytest

from gearlab.parallel import distributed
from gearlab.config import ConfigError, conf_dir, load_config
from gearlab.trainer.train import preflight

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
