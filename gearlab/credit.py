"""The credit-assignment plug-in interface and its registry.

A credit assigner is a pure function over one complete rollout record: it receives the batch,
the sequence-level GRPO advantages and the signals it declared, and returns per-token
advantages. The core never imports a concrete assigner; it looks them up here by name.
"""
from __future__ import annotations

import enum
import importlib
import importlib.metadata
import importlib.util
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, TypeVar

from torch import Tensor

from gearlab.batch import RolloutBatch

ENTRY_POINT_GROUP = "gearlab.assigners"


class Signal(str, enum.Enum):
    """Per-token quantities an assigner may ask the SignalProvider for. All are [B, T] over
    response positions, computed without gradient on the (temperature-scaled) policy."""

    ENTROPY = "entropy"  # H_t of the policy, nats
    LOGPROBS = "logprobs"  # log π_old(y_t) of the sampled tokens (the student's own view)
    TEACHER_LOGPROBS = "teacher_logprobs"  # log π_T(y_t | x ⊕ c, y_<t), privileged-context teacher
    TEACHER_KL = "teacher_kl"  # KL(π_S || π_T) over the full vocabulary at each position
    TEACHER_ENTROPY = "teacher_entropy"  # H_t of the teacher
    INPUT_GRAD_SALIENCY = "input_grad_saliency"  # OAR-G: |<dJ/de_t, e_t>| on reasoning tokens, 0 elsewhere
    PERTURBATION_SALIENCY = "perturbation_saliency"  # OAR-P: effect of masking token t on the outcome
    REASONING_MASK = "reasoning_mask"  # 1 on the response tokens before the final-answer span (float 0/1)


@dataclass
class CreditOutput:
    """What an assigner returns.

    token_advantages [B, T] float: advantage of every response token (0 where masked).
    loss_mask        [B, T] bool or None: tokens that enter the policy loss; None = response_mask.
                     Tokens outside it are excluded from the loss and from its token counts.
    metrics          scalar diagnostics, logged under ``credit/``.
    """

    token_advantages: Tensor
    loss_mask: Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class CreditAssigner(ABC):
    """Turns sequence advantages into token advantages.

    Subclasses set ``name`` (via ``@register``), ``needs`` (the signals to compute) and accept their
    options as keyword arguments of ``__init__`` (they come from ``conf/assigner/<name>.yaml``).
    """

    name: ClassVar[str] = ""
    needs: ClassVar[frozenset[Signal]] = frozenset()
    # Promises checked by the contract kit (gearlab.contract / `gearlab check-assigner`):
    preserves_sign: ClassVar[bool] = False  # sign(A_{i,t}) == sign(A_i) wherever A_{i,t} != 0
    preserves_mass: ClassVar[bool] = False  # Σ_t A_{i,t} == N_i · A_i (N_i = generated tokens of i)
    requires_turns: ClassVar[bool] = False  # needs batch.turn_ids / turn_rewards (multi-turn tasks only)
    keeps_zero_groups: ClassVar[bool] = True  # a sequence with A_i = 0 gets 0 on every token (False for pure distillation)

    # Teacher of the teacher signals: "live" = the current policy weights (default), "frozen" = a copy
    # re-synced every `teacher_sync_every` iterations (0 = never), "ema" = an exponential moving average
    # of the policy with decay `teacher_ema`. "answer" / "solution" = what the privileged prompt adds.
    teacher_mode: str = "live"
    teacher_sync_every: int = 0
    teacher_ema: float = 0.99
    teacher_context: str = "answer"

    def signal_options(self) -> dict[str, Any]:
        """Options for the signal computations (e.g. saliency noise); read by the SignalProvider."""
        return {}

    def setup(self, *, seed: int, total_steps: int, task: Any) -> None:
        """Called once before any work (also by preflight): validate against the task, e.g. a turn
        method raises ValueError on a single-turn task. The default does nothing."""

    def on_step_end(self, step: int) -> None:
        """Called after each optimizer iteration (for schedules such as a decaying λ)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    @abstractmethod
    def assign(self, batch: RolloutBatch, seq_advantages: Tensor, signals: dict[Signal, Tensor]) -> CreditOutput:
        """seq_advantages [B] → CreditOutput with token_advantages [B, T]."""


_REGISTRY: dict[str, type[CreditAssigner]] = {}
_PLUGINS_LOADED = False
A = TypeVar("A", bound=type[CreditAssigner])


def register(name: str) -> Callable[[A], A]:
    """Class decorator: make an assigner available under ``name``. Duplicate names are an error."""

    def deco(cls: A) -> A:
        if not (isinstance(cls, type) and issubclass(cls, CreditAssigner)):
            raise TypeError(f"@register({name!r}) must decorate a CreditAssigner subclass, got {cls!r}")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            old = _REGISTRY[name]
            raise ValueError(
                f"credit assigner {name!r} is already registered by {old.__module__}.{old.__qualname__}"
            )
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def _load_plugins() -> None:
    """Import the bundled assigners and every module of the ``gearlab.assigners`` entry-point group."""
    global _PLUGINS_LOADED
    if _PLUGINS_LOADED:
        return
    _PLUGINS_LOADED = True
    importlib.import_module("gearlab.assigners")
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        ep.load()


def load_module(spec: str) -> None:
    """Import an assigner module given as a dotted import path or a ``.py`` file path."""
    if spec.endswith(".py"):
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"assigner plug-in file not found: {spec}")
        mod_name = f"gearlab_plugin_{path.stem}"
        if mod_name in sys.modules:
            return
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        module_spec.loader.exec_module(module)
    else:
        importlib.import_module(spec)


def available() -> list[str]:
    """Sorted names of all registered assigners (bundled and plug-ins)."""
    _load_plugins()
    return sorted(_REGISTRY)


def get(name: str) -> type[CreditAssigner]:
    """The assigner class registered as ``name``; unknown names list the known ones."""
    _load_plugins()
    if name not in _REGISTRY:
        raise KeyError(f"unknown credit assigner {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def build(name: str, options: dict[str, Any] | None = None) -> CreditAssigner:
    """Instantiate the assigner ``name`` with its options; a wrong option names the assigner."""
    cls = get(name)
    try:
        return cls(**(options or {}))
    except TypeError as e:
        raise ValueError(f"assigner {name!r}: bad options {sorted((options or {}).keys())}: {e}") from e
