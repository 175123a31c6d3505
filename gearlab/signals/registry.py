"""The vocabulary of per-token signals and the registry of the functions that compute them.

A signal is a [B, T] float tensor over response positions (0 where ``response_mask`` is 0), computed without
gradient for an assigner that declared it in ``needs``. Two kinds:
  * pass signals — by-products of the SignalProvider's student / teacher forwards (entropy, log-probs, teacher
    log-probs / entropy / KL); declared here, computed in ``gearlab.signals.provider``;
  * model-based signals — a function of a :class:`SignalContext`, registered with ``@register_signal(name)``
    (the OAR saliencies, the reasoning-span mask, or one of your own).

Adding a signal: one module with a ``@register_signal("my_signal", fake="nonneg")`` function, either in this
package or in your own, announced through the ``gearlab.signals`` entry-point group (or imported through
``assigner.plugins``); an assigner then lists ``"my_signal"`` in its ``needs``. ``fake`` tells the contract kit
how to make random, well-formed values for it (see ``FAKES``).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from torch import Tensor, nn

from gearlab.core.batch import RolloutBatch
from gearlab.plugins import load_plugins

ENTRY_POINT_GROUP = "gearlab.signals"


class Signal(str, enum.Enum):
    """The built-in signals. All are [B, T] over response positions, computed without gradient on the
    (temperature-scaled) policy. Plug-in signals are plain strings; a ``Signal`` equals its string value."""

    ENTROPY = "entropy"  # H_t of the policy, nats
    LOGPROBS = "logprobs"  # log π_old(y_t) of the sampled tokens (the student's own view)
    TEACHER_LOGPROBS = "teacher_logprobs"  # log π_T(y_t | x ⊕ c, y_<t), privileged-context teacher
    TEACHER_KL = "teacher_kl"  # KL(π_S || π_T) over the full vocabulary at each position
    TEACHER_ENTROPY = "teacher_entropy"  # H_t of the teacher
    INPUT_GRAD_SALIENCY = "input_grad_saliency"  # OAR-G: |<dJ/de_t, e_t>| on reasoning tokens, 0 elsewhere
    PERTURBATION_SALIENCY = "perturbation_saliency"  # OAR-P: effect of masking token t on the outcome
    REASONING_MASK = "reasoning_mask"  # 1 on the response tokens before the final-answer span (float 0/1)


# How the contract kit fakes a signal's values (before the response mask is applied):
#   entropy: U[0, 3) · logprob: −exp(N(0,1)) · kl: exp(N(0,1) − 1) · nonneg: |N(0,1)| · signed: N(0,1)
#   · reasoning_mask: 1 on each response but its last k ∈ [1, 5] tokens · mask: Bernoulli(0.5) · prob: U(0, 1]
FAKES = ("entropy", "logprob", "kl", "nonneg", "signed", "reasoning_mask", "mask", "prob")


@dataclass
class SignalContext:
    """Everything a model-based signal function may use. ``model`` is the policy (eval mode, its
    parameters may require grad). The provider calls a signal function under ``torch.no_grad``: one that
    backpropagates turns autograd on itself (``torch.enable_grad``), uses ``torch.autograd.grad`` on inputs only
    and leaves no ``.grad`` on parameters."""

    model: nn.Module
    tokenizer: Any
    batch: RolloutBatch
    temperature: float
    chunk_size: int
    micro_batch_size: int
    options: dict[str, Any] = field(default_factory=dict)
    # continues the batch's responses from their prefixes (gearlab.signals.mc.Resampler): Monte-Carlo signals only
    resampler: Any = None
    # [B] bool, the rows whose values are wanted (None = every row): a costly signal may skip the others, which the
    # provider sets to 0 (the trainer passes the rows with A_i != 0 to a method that ``ignores_zero_rows``)
    rows: Tensor | None = None

    def wanted(self, i: int) -> bool:
        """Whether row ``i``'s values are wanted."""
        return self.rows is None or bool(self.rows[i])


SignalFn = Callable[[SignalContext], Tensor]


@dataclass(frozen=True)
class SignalSpec:
    """A registered signal: ``fn`` computes it ([B, T] float; None = a pass signal the provider computes),
    ``fake`` is how the contract kit fakes it (one of ``FAKES``), ``runs_model`` whether it runs the policy,
    ``resamples`` whether it continues the responses through a resampler (``gearlab.signals.mc``)."""

    name: str
    fn: SignalFn | None
    fake: str
    doc: str = ""
    runs_model: bool = True  # False: read from the tokens alone (a span mask), no forward of the policy
    resamples: bool = False  # True: generates continuations, which gather a sharded policy for generation themselves

    @property
    def needs_gathered_weights(self) -> bool:
        """Whether the provider must hold a sharded policy gathered while this signal runs: it runs the policy's
        forwards itself (a pass signal is the provider's own forward; a resampling one gathers for generation)."""
        return self.fn is not None and self.runs_model and not self.resamples


_REGISTRY: dict[str, SignalSpec] = {}


def signal_name(signal: Signal | str) -> str:
    """The registry key of a signal: a ``Signal``'s value, or the plug-in's own string."""
    return signal.value if isinstance(signal, Signal) else str(signal)


def _add(spec: SignalSpec) -> None:
    if spec.fake not in FAKES:
        raise ValueError(f"signal {spec.name!r}: fake={spec.fake!r} is not one of {', '.join(FAKES)}")
    old = _REGISTRY.get(spec.name)
    if old is not None and old.fn is not None and spec.fn is not None and \
            (old.fn.__module__, old.fn.__qualname__) != (spec.fn.__module__, spec.fn.__qualname__):
        raise ValueError(f"signal {spec.name!r} already has a function: {old.fn.__module__}.{old.fn.__qualname__}")
    _REGISTRY[spec.name] = spec


def register_signal(signal: Signal | str, *, fake: str = "nonneg", doc: str = "", runs_model: bool = True,
                    resamples: bool = False) -> Callable[[SignalFn], SignalFn]:
    """Decorator: ``fn(ctx: SignalContext) -> Tensor [B, T]`` computes ``signal`` (values on masked positions
    are zeroed by the provider). ``runs_model=False`` declares that it reads the tokens only (no forward), so a
    sharded policy need not be gathered for it; ``resamples=True`` that it continues responses through
    ``SignalContext.resampler`` (which the caller must then pass). A second, different function for one name is an
    error."""

    def deco(fn: SignalFn) -> SignalFn:
        _add(SignalSpec(signal_name(signal), fn, fake, doc or (fn.__doc__ or "").strip().split("\n")[0], runs_model,
                        resamples))
        return fn

    return deco


# the pass signals: computed by the provider's forwards, declared here so every signal has one registration
for _sig, _fake in ((Signal.ENTROPY, "entropy"), (Signal.TEACHER_ENTROPY, "entropy"), (Signal.LOGPROBS, "logprob"),
                    (Signal.TEACHER_LOGPROBS, "logprob"), (Signal.TEACHER_KL, "kl")):
    _add(SignalSpec(_sig.value, None, _fake, "computed by the SignalProvider's student / teacher forward"))
PASS_SIGNALS = frozenset(s for s, spec in _REGISTRY.items() if spec.fn is None)
TEACHER_SIGNALS = frozenset({Signal.TEACHER_LOGPROBS.value, Signal.TEACHER_KL.value, Signal.TEACHER_ENTROPY.value})


def load_builtin_and_installed() -> None:
    """Import every module of this package (built-in signals register on import) and every module of the
    ``gearlab.signals`` entry-point group. Idempotent."""
    load_plugins(__name__.rpartition(".")[0], ENTRY_POINT_GROUP)  # this package's modules + the group


def get_signal(signal: Signal | str) -> SignalSpec:
    """The registration of ``signal``; an unknown name lists the known ones."""
    load_builtin_and_installed()
    name = signal_name(signal)
    if name not in _REGISTRY:
        raise KeyError(f"unknown signal {name!r}; known: {', '.join(available_signals())}")
    return _REGISTRY[name]


def needs_resampler(needs: Iterable[Signal | str]) -> bool:
    """Whether signals ``needs`` include one that continues responses (``SignalSpec.resamples``): the caller must
    then pass a resampler. Unknown names do not count (they are refused where the signals are computed)."""
    load_builtin_and_installed()
    return any(_REGISTRY[n].resamples for n in map(signal_name, needs) if n in _REGISTRY)


def signals_on_gathered_weights(needs: Iterable[Signal | str]) -> list[str]:
    """Sorted names of the signals of ``needs`` that run a sharded policy's forwards themselves
    (``SignalSpec.needs_gathered_weights``): the provider holds the weights gathered while they run, and training
    refuses FSDP1 on several processes with any of them."""
    return sorted(signal_name(s) for s in needs if get_signal(s).needs_gathered_weights)


def available_signals() -> list[str]:
    """Sorted names of every registered signal (built-in and plug-in)."""
    load_builtin_and_installed()
    return sorted(_REGISTRY)
