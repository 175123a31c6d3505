"""Which dtype the policy's parameters are loaded in (gearlab.models.loading.policy_dtype)."""
import pytest
import torch

from gearlab.config import load_config
from gearlab.models.loading import policy_dtype


@pytest.mark.parametrize("dtype,precision,cuda,want", [
    ("auto", "32-true", False, torch.float32),
    ("auto", "bf16-mixed", False, torch.float32),
    ("auto", "32-true", True, torch.bfloat16),
    # mixed precision keeps fp32 master weights: a bf16 parameter would drop AdamW steps of lr 1e-5
    ("auto", "bf16-mixed", True, torch.float32),
    ("auto", "bf16-true", True, torch.bfloat16),
    ("float32", "32-true", True, torch.float32),
    ("bfloat16", "bf16-mixed", True, torch.bfloat16),
    ("bfloat16", "32-true", False, torch.bfloat16),
])
def test_policy_dtype(dtype, precision, cuda, want):
    cfg = load_config([f"model.dtype={dtype}", f"trainer.precision={precision}"])
    assert policy_dtype(cfg, cuda=cuda) == want


def test_a_bfloat16_parameter_drops_an_rl_sized_adamw_step():
    """Why the master weights stay fp32: the first AdamW step moves each weight by about lr; in bf16 that is lost."""
    torch.manual_seed(0)
    w32 = torch.nn.Parameter(torch.randn(4096) * 0.05)
    w16 = torch.nn.Parameter(w32.detach().to(torch.bfloat16))
    for w in (w32, w16):
        opt = torch.optim.AdamW([w], lr=1e-5, weight_decay=0.0)
        before = w.detach().clone()
        w.grad = torch.randn_like(w)
        opt.step()
        w.moved = (w.detach() != before).float().mean().item()
    assert w32.moved == 1.0
    assert w16.moved < 0.1  # 7%: only weights near 0 are fine-grained enough to move


def test_training_bf16_parameters_at_a_small_lr_warns(caplog):
    from gearlab.models.loading import warn_bf16_training

    with caplog.at_level("WARNING", logger="gearlab"):
        warn_bf16_training(torch.nn.Linear(2, 2).to(torch.bfloat16), 1e-5)
        warn_bf16_training(torch.nn.Linear(2, 2), 1e-5)  # fp32 master weights: nothing to say
        warn_bf16_training(torch.nn.Linear(2, 2).to(torch.bfloat16), 1e-3)
    assert len(caplog.records) == 1 and "bfloat16" in caplog.records[0].getMessage()


def test_a_warm_start_made_with_other_settings_is_not_reused(tmp_path):
    """The embedded warm start's folder name does not depend on warmstart.*: a folder made with 600 steps must not
    silently stand in for a config that asks for 300 (a comparison preset with a weaker start would train from the
    wrong model)."""
    from gearlab.commands.compare import _start_model
    from gearlab.config import ConfigError
    from gearlab.models.loading import embedded_dir, load_policy
    from gearlab.models.shipped import copy_shipped

    base = [f"trainer.output_dir={tmp_path}", "model.name_or_path=embedded:tiny-arith"]
    copy_shipped(embedded_dir(load_config(base), "embedded:tiny-arith"))  # the default recipe: 600 steps, lr 3e-3
    model, _, _ = load_policy(load_config(base))
    assert sum(p.numel() for p in model.parameters()) == 1_242_432
    assert _start_model(load_config(base)).endswith("embedded/tiny-arith")
    for override, named in (("warmstart.steps=300", "warmstart.steps=300 (it has 600)"),
                            ("warmstart.lr=0.001", "warmstart.lr=0.001 (it has 0.003)")):
        for call in (load_policy, _start_model):
            with pytest.raises(ConfigError) as e:
                call(load_config([*base, override]))
            assert named in str(e.value) and "\n" not in str(e.value)


def test_a_warm_start_made_on_another_kind_of_task_is_not_reused(tmp_path):
    """The folder embedded/tiny-arith is named for the model, not the task: the shipped arith warm start must not
    silently serve task=tool_arith (0 of 512 episodes solved: the model never learnt the call format), while a task
    variant of the same kind (arith_hard after arith) reuses it, as documented."""
    from gearlab.commands.compare import _start_model
    from gearlab.config import ConfigError
    from gearlab.models.loading import embedded_dir, load_policy
    from gearlab.models.shipped import copy_shipped

    base = [f"trainer.output_dir={tmp_path}", "model.name_or_path=embedded:tiny-arith"]
    copy_shipped(embedded_dir(load_config(base), "embedded:tiny-arith"))
    assert _start_model(load_config([*base, "task=arith_hard"])).endswith("embedded/tiny-arith")
    for call in (load_policy, _start_model):
        with pytest.raises(ConfigError) as e:
            call(load_config([*base, "task=tool_arith"]))
        msg = str(e.value)
        assert "task 'arith' (ArithmeticTask)" in msg and "task=tool_arith (ToolArithTask)" in msg and "\n" not in msg
