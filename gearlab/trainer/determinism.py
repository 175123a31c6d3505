"""Deterministic CUDA kernels for a training run (``trainer.deterministic``): the same command repeats every
iteration bit for bit on one kind of card.

Without them a GPU run does not repeat itself: two runs of one SmolLM2-135M configuration on an H100 had the same
first rollout but a different gradient norm in iteration 0 (5th significant digit) and different rollouts from
iteration 1, through fused attention's backward (PyTorch warns "Memory Efficient attention defaults to a
non-deterministic algorithm"), whose reductions run in whatever order the card schedules. With
``torch.use_deterministic_algorithms(True)`` (strict: ``warn_only`` leaves that backward as it is) and cuBLAS's fixed
workspace, the two runs were equal in every iteration, at the same wall time. The decode and the first rollout were
unchanged by it. A CPU run is unaffected: its kernels are pinned by ``gearlab.cpu_kernels``.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from gearlab.config import Config, ConfigError

_RESUMES = "the run's last checkpoint is kept: the same command with it resumes"


@contextlib.contextmanager
def deterministic_kernels(cfg: Config, *, after: str = _RESUMES) -> Iterator[bool]:
    """Deterministic algorithms for the duration of a run when ``cfg.trainer.deterministic`` and the run will train on
    CUDA (``trainer.accelerator`` auto / gpu / cuda with a card present); yields whether it turned them on. Enter it
    before the first CUDA work: cuBLAS reads ``CUBLAS_WORKSPACE_CONFIG`` when it makes its first handle (the variable
    stays set afterwards; alone it only fixes cuBLAS's workspace). On exit PyTorch's previous setting is back, so code
    that runs after ``train()`` in the same process is not held to it. With ``rollout.engine=vllm`` the setting is
    ``warn_only`` (vLLM's own torch code is not checked for it here, so an op of its without a deterministic kernel
    warns instead of stopping the rollout). PyTorch's refusal of an op without a deterministic kernel leaves as the
    one-line ConfigError of ``explain_nondeterministic_op`` (``after``: what the user's next command keeps)."""
    if not cfg.trainer.deterministic or cfg.trainer.accelerator not in ("auto", "gpu", "cuda") \
            or not torch.cuda.is_available():
        yield False
        return
    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=cfg.rollout.engine == "vllm")
    try:
        yield True
    except RuntimeError as e:
        err = explain_nondeterministic_op(e, after)
        if err is None:
            raise
        raise err from e
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


def explain_nondeterministic_op(e: RuntimeError, after: str = _RESUMES) -> ConfigError | None:
    """The one-line error for PyTorch's refusal of an op without a deterministic CUDA kernel, else None; ``after``
    ends it in parentheses."""
    msg = str(e)
    if "does not have a deterministic implementation" not in msg:
        return None
    op = msg.split(" does not have", 1)[0].strip().splitlines()[-1]
    return ConfigError(f"key 'trainer.deterministic': {op} has no deterministic CUDA kernel; set "
                       f"trainer.deterministic=false to run without bit-for-bit repeats ({after})")
