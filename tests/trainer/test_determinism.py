"""``trainer.deterministic``: deterministic CUDA kernels for a training run, only where it trains on CUDA, strict
(``warn_only`` would leave fused attention's backward non-deterministic), and PyTorch's refusal of an op made one
line naming the key."""
from __future__ import annotations

import os

import pytest
import torch

from gearlab.config import ConfigError, load_config
from gearlab.trainer.determinism import deterministic_kernels, explain_nondeterministic_op


@pytest.fixture
def restore_flags(monkeypatch):
    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    yield
    torch.use_deterministic_algorithms(was[0], warn_only=was[1])


def test_a_cpu_run_keeps_torchs_setting(restore_flags):
    before = torch.are_deterministic_algorithms_enabled()
    if torch.cuda.is_available():
        pytest.skip("this machine has a card")
    with deterministic_kernels(load_config([])) as on:
        assert on is False
        assert torch.are_deterministic_algorithms_enabled() == before
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


@pytest.mark.parametrize("overrides,on,warn_only", [
    ([], True, False),  # the default: strict
    (["rollout.engine=vllm"], True, True),
    (["trainer.deterministic=false"], False, None),
    (["trainer.accelerator=cpu"], False, None),
])
def test_a_cuda_run_turns_strict_determinism_on(restore_flags, monkeypatch, overrides, on, warn_only):
    torch.use_deterministic_algorithms(False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with deterministic_kernels(load_config(overrides)) as turned_on:
        assert turned_on is on
        assert torch.are_deterministic_algorithms_enabled() is on
        if on:
            assert torch.is_deterministic_algorithms_warn_only_enabled() is warn_only
            assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.are_deterministic_algorithms_enabled() is False  # the process's setting is back after the run


def test_the_previous_setting_is_back_even_when_the_run_fails(restore_flags, monkeypatch):
    torch.use_deterministic_algorithms(True, warn_only=True)  # e.g. a notebook that chose warn_only itself
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="boom"), deterministic_kernels(load_config([])):
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # strict inside the run
        raise RuntimeError("boom")
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()


REFUSAL = (  # the text of ATen's alertNotDeterministic
    "index_add_cuda_ does not have a deterministic implementation, but you set "
    "'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this operation, or you "
    "can use the 'warn_only=True' option, if that's acceptable for your application.")


def test_pytorchs_refusal_becomes_one_line_naming_the_key():
    refusal = RuntimeError(REFUSAL)
    err = explain_nondeterministic_op(refusal)
    assert err is not None and "\n" not in str(err)
    assert str(err).startswith("key 'trainer.deterministic': index_add_cuda_ has no deterministic CUDA kernel")
    assert "trainer.deterministic=false" in str(err)
    assert explain_nondeterministic_op(RuntimeError("CUDA out of memory")) is None


def test_a_refusal_inside_the_context_leaves_it_as_that_line(restore_flags, monkeypatch):
    torch.use_deterministic_algorithms(False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError) as got, deterministic_kernels(load_config([]), after="nothing was written"):
        raise RuntimeError(REFUSAL)
    assert str(got.value).endswith("trainer.deterministic=false to run without bit-for-bit repeats (nothing was "
                                   "written)")
    assert isinstance(got.value.__cause__, RuntimeError)  # PyTorch's own message stays in the chain
    assert torch.are_deterministic_algorithms_enabled() is False
