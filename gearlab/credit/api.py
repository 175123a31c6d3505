"""The credit-assignment plug-in interface and its registry.

A credit assigner is a pure function over one complete rollout record: it receives the batch,
the sequence-level GRPO advantages and the signals it declared, and returns per-token
advantages. The core never imports a concrete assigner; it looks them up here by name.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, TypeVar

from torch import Tensor

from gearlab.core.batch import RolloutBatch
from gearlab.credit.options import OptionError, parse_options
from gearlab.plugins import import_plugin, load_plugins
from gearlab.signals.registry import Signal

ENTRY_POINT_GROUP = "gearlab.assigners"


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

    Subclasses set ``name`` (via ``@register``), ``needs`` (the signals to compute) and declare their options
    as a dataclass ``Options`` (``gearlab.credit.options``: type, default and doc of each in one place); the
    base ``__init__`` checks ``assigner.options`` against it and sets each option as an attribute. A subclass
    without ``Options`` may instead take keyword arguments in its own ``__init__``.
    """

    #: the options dataclass; None = no typed options (the class's own ``__init__`` keywords, if any)
    Options: ClassVar[type | None] = None

    name: ClassVar[str] = ""
    needs: ClassVar[frozenset[Signal]] = frozenset()
    # Promises checked by the contract kit (gearlab.credit.contract / `gearlab check-assigner`):
    preserves_sign: ClassVar[bool] = False  # sign(A_{i,t}) == sign(A_i) wherever A_{i,t} != 0
    preserves_mass: ClassVar[bool] = False  # Σ_t A_{i,t} == N_i · A_i (N_i = generated tokens of i)
    requires_turns: ClassVar[bool] = False  # needs batch.turn_ids / turn_rewards (multi-turn tasks only)
    # a sequence with A_i = 0 gets 0 on every token (False for pure distillation)
    keeps_zero_groups: ClassVar[bool] = True
    # the credit of a sequence with A_i != 0 does not depend on the signals of the sequences with A_i = 0 (which get
    # 0): a model-based signal may then leave those rows out (SignalContext.rows; `signals.skip_zero_rows`)
    ignores_zero_rows: ClassVar[bool] = False
    # samples extra rollouts (Monte-Carlo continuations): left out of inspect / credit-eval / replay's default method
    # lists, which run every method on one batch (name it there to include it)
    extra_rollouts: ClassVar[bool] = False

    # Teacher of the teacher signals: "live" = the current policy weights (default), "frozen" = a copy
    # re-synced every `teacher_sync_every` iterations (0 = never), "ema" = an exponential moving average
    # of the policy with decay `teacher_ema`. "answer" / "solution" = what the privileged prompt adds.
    teacher_mode: str = "live"
    teacher_sync_every: int = 0
    teacher_ema: float = 0.99
    teacher_context: str = "answer"

    def __init__(self, **options: Any) -> None:
        """Typed options: ``options`` checked against ``Options`` (OptionError naming ``assigner.options.<key>``),
        then each set as an attribute of the same name; ``self.options`` keeps the parsed dataclass."""
        if self.Options is None:
            if options:
                raise OptionError(f"assigner.options.{next(iter(options))}", f"assigner {self.name!r} takes no options")
            self.options = None
            return
        self.options = parse_options(self.Options, options, self.name)
        for f in dataclasses.fields(self.Options):
            setattr(self, f.name, getattr(self.options, f.name))

    def chunk_local(self, rows: int) -> bool:
        """True if ``assign`` called on consecutive chunks of ``rows`` rows, one chunk at a time, returns exactly
        those rows of one whole-batch call (given the same signals), and returns no loss mask. The trainer may then
        take the policy's entropy from the update's own forward instead of a separate pass (on-policy runs,
        ``signals.entropy_in_forward``). The default, False, is always safe."""
        return False

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
    load_plugins("gearlab.assigners", ENTRY_POINT_GROUP)


def load_module(spec: str) -> None:
    """Import an assigner module given as a dotted import path or a ``.py`` file path."""
    import_plugin(spec)


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
