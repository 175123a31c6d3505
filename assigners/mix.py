"""``mix``: composed credit — a weighted sum of other methods' token advantages, sharing one computation of every
signal (one teacher pass). This is the answer to "λ·A_GRPO + (1−λ)·A_self-distillation with one teacher pass"
(``grpo_opsd``: grpo 0.5 + opsd 0.5); docs/credit/mix.md.

    A_{i,t} = Σ_k w_k · A^k_{i,t} · M^k_{i,t}        M^k = component k's loss_mask, or response_mask when it has none
    loss_mask = None if no component returns one, else ∪_k M^k (logical OR)

Loss-mask rule: a token trains if any component trains it; a component contributes nothing on tokens it
excluded. With one component of weight 1 the effective credit (A · loss_mask) and the loss mask are that
component's; only values on tokens outside the loss (which never reach the gradient) may differ.

Components (``components``): each a method label (a registered assigner, a variant of ``conf/assigner/`` or a grid
label such as ``gear:q_on=0.8``; weight 1.0) or ``{method: LABEL, weight: W (1.0), options: {...} ({})}``; each is
built as ``build(base, {**label options, **options})``. A component may not be a ``mix``.

Promises: ``preserves_sign`` = every component preserves sign and every w_k ≥ 0; ``preserves_mass`` = every
component preserves mass and Σ_k w_k = 1 (±1e-9); ``requires_turns`` = any component's; ``keeps_zero_groups`` =
every component's. ``needs`` is the union of the components' needs, so each signal is computed once per batch.

Teacher sharing: the trainer runs one teacher, configured from the mix's ``teacher_*`` attributes, so the
components that need a teacher signal must agree on ``teacher_mode`` and ``teacher_context`` (and on
``teacher_sync_every`` when frozen, ``teacher_ema`` when ema); otherwise construction fails naming the
disagreement. The mix copies the agreed settings (the base class defaults when no component needs a teacher).
``signal_options`` is the merge of the components' (a key set to two values is refused). ``setup``,
``on_step_end``, ``state_dict`` (``{"components": [...]}``) and ``load_state_dict`` are forwarded to every component.

Metrics: each component's under ``<label>/<key>`` (``<label>#<index>`` when a label repeats), and
``mix/<label>_abs_share`` = Σ|w_k A^k M^k| / Σ_j Σ|w_j A^j M^j| over the generated tokens (0 if the sum is 0).
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gearlab.core.batch import RolloutBatch
from gearlab.credit import CreditAssigner, CreditOutput, Signal, build, register
from gearlab.credit.methods import method_spec
from gearlab.credit.options import OptionError, option, plain
from gearlab.signals.registry import TEACHER_SIGNALS  # the trainer's test of "needs a teacher" (one place)

KEY = "assigner.options.components"


@dataclass
class MixOptions:
    # the option kit checks only that this is a list; MixAssigner validates every entry itself
    components: list = option([{"method": "grpo", "weight": 0.5}, {"method": "opsd", "weight": 0.5}],
                              "methods summed: a label (weight 1) or {method: LABEL, weight: W, options: {...}}")


def _entry(i: int, e: Any) -> tuple[str, float, dict[str, Any]]:
    """(label, weight, extra options) of entry ``i``, or OptionError naming what is wrong with it."""
    if isinstance(e, str):
        return e, 1.0, {}
    if not isinstance(e, Mapping):
        raise OptionError(
            KEY, f"entry {i}: expected a method label or a mapping {{method, weight, options}}, got {e!r}"
        )
    if set(e) - {"method", "weight", "options"}:
        raise OptionError(KEY, f"entry {i}: unknown keys {sorted(set(e) - {'method', 'weight', 'options'})}; "
                               "allowed: method, weight, options")
    label, w, opts = e.get("method"), e.get("weight", 1.0), e.get("options", {})
    if not isinstance(label, str) or not label:
        raise OptionError(KEY, f"entry {i}: 'method' must be a method label, got {label!r}")
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
        raise OptionError(KEY, f"entry {i} ({label}): weight must be a finite number, got {w!r}")
    if not isinstance(opts, Mapping):
        raise OptionError(KEY, f"entry {i} ({label}): options must be a mapping, got {opts!r}")
    return label, float(w), dict(opts)


@register("mix")
class MixAssigner(CreditAssigner):
    """Composed credit: a weighted sum of other methods' token advantages, one computation of every signal."""

    # the class attributes describe the default (grpo 0.5 + opsd 0.5); every instance derives its own
    needs = frozenset({Signal.TEACHER_LOGPROBS, Signal.LOGPROBS})
    keeps_zero_groups = False
    teacher_context = "solution"

    Options = MixOptions

    def __init__(self, **options: Any) -> None:
        if "components" in options:  # a ListConfig is not a list to the option kit
            options = {**options, "components": plain(options["components"])}
        super().__init__(**options)
        if not self.components:
            raise OptionError(KEY, "needs at least one component")
        entries = [_entry(i, e) for i, e in enumerate(self.components)]
        counts = Counter(label for label, _, _ in entries)
        self.labels = [lab if counts[lab] == 1 else f"{lab}#{i}" for i, (lab, _, _) in enumerate(entries)]
        self.weights = [w for _, w, _ in entries]
        self.parts: list[CreditAssigner] = []
        for i, (label, _, extra) in enumerate(entries):
            try:
                spec = method_spec(label)
            except (KeyError, ValueError) as e:
                raise OptionError(KEY, f"entry {i}: {str(e).strip(chr(34))}") from None
            if spec.base == self.name:
                raise OptionError(KEY, f"entry {i} ({label}) is itself a mix; list its components instead")
            try:
                self.parts.append(build(spec.base, {**spec.options, **extra}))
            except OptionError as e:
                raise OptionError(KEY, f"entry {i} ({label}): {e.key.rpartition('.')[2]}: {e.message}") from None
            except ValueError as e:
                raise OptionError(KEY, f"entry {i} ({label}): {e}") from None
        parts = self.parts
        self.needs = frozenset().union(*(p.needs for p in parts))
        self.preserves_sign = all(p.preserves_sign for p in parts) and all(w >= 0 for w in self.weights)
        self.preserves_mass = all(p.preserves_mass for p in parts) and abs(sum(self.weights) - 1.0) <= 1e-9
        self.requires_turns = any(p.requires_turns for p in parts)
        self.keeps_zero_groups = all(p.keeps_zero_groups for p in parts)
        self._share_teacher()
        self._signal_options = self._merge_signal_options()

    def _share_teacher(self) -> None:
        """Copy the teacher settings the teacher-using components agree on (one teacher pass serves all)."""
        users = [(lab, p) for lab, p in zip(self.labels, self.parts) if frozenset(p.needs) & TEACHER_SIGNALS]
        if not users:  # no teacher forward runs: the base class defaults, whatever the class attributes say
            base = CreditAssigner
            self.teacher_mode, self.teacher_context = base.teacher_mode, base.teacher_context
            self.teacher_sync_every, self.teacher_ema = base.teacher_sync_every, base.teacher_ema
            return
        keys = ["teacher_mode", "teacher_context"]
        mode = users[0][1].teacher_mode
        keys += ["teacher_sync_every"] if mode == "frozen" else ["teacher_ema"] if mode == "ema" else []
        for key in keys:
            values = {getattr(p, key) for _, p in users}
            if len(values) > 1:
                said = ", ".join(f"{lab}: {getattr(p, key)}" for lab, p in users)
                raise OptionError(KEY, f"components disagree on {key} ({said}): one teacher pass serves all; "
                                       "set it in a component's options")
        first = users[0][1]
        self.teacher_mode, self.teacher_context = first.teacher_mode, first.teacher_context
        self.teacher_sync_every, self.teacher_ema = first.teacher_sync_every, first.teacher_ema

    def _merge_signal_options(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        owner: dict[str, str] = {}
        for lab, p in zip(self.labels, self.parts):
            for k, v in p.signal_options().items():
                if k in merged and merged[k] != v:
                    raise OptionError(KEY, f"components disagree on signal option {k!r} ({owner[k]}: {merged[k]!r}, "
                                           f"{lab}: {v!r}): signals are computed once for all")
                merged[k], owner[k] = v, lab
        return merged

    # -- forwarded hooks ----------------------------------------------------------------------
    def signal_options(self) -> dict[str, Any]:
        return dict(self._signal_options)

    def setup(self, *, seed: int, total_steps: int, task: Any) -> None:
        for p in self.parts:
            p.setup(seed=seed, total_steps=total_steps, task=task)

    def on_step_end(self, step: int) -> None:
        for p in self.parts:
            p.on_step_end(step)

    def state_dict(self) -> dict[str, Any]:
        return {"components": [p.state_dict() for p in self.parts]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        states = state.get("components", [])
        if len(states) != len(self.parts):  # a checkpoint of another mix: refuse rather than misassign
            raise ValueError(f"mix: checkpoint has {len(states)} component states, this mix has {len(self.parts)}")
        for p, s in zip(self.parts, states):
            p.load_state_dict(s)

    # -- credit -------------------------------------------------------------------------------
    def assign(self, batch: RolloutBatch, seq_advantages: Tensor, signals: dict[Signal, Tensor]) -> CreditOutput:
        """seq_advantages [B] → token_advantages [B, T] = Σ_k w_k A^k M^k; loss_mask [B, T] bool (union) or None."""
        resp = batch.response_mask.bool()  # [B, T]
        total = torch.zeros(resp.shape, dtype=torch.float32, device=resp.device)
        union = torch.zeros_like(resp)
        any_mask = False
        metrics: dict[str, float] = {}
        contrib: list[float] = []
        for lab, w, p in zip(self.labels, self.weights, self.parts):
            out = p.assign(batch, seq_advantages, signals)
            any_mask |= out.loss_mask is not None
            m = resp if out.loss_mask is None else out.loss_mask.to(resp.device).bool()
            union |= m  # a component without a loss mask trains every generated token
            part = w * out.token_advantages.to(resp.device).float() * m.float()  # [B, T]
            total = total + part
            contrib.append(float(part[resp].abs().sum()))
            metrics.update({f"{lab}/{k}": float(v) for k, v in out.metrics.items()})
        denom = sum(contrib)
        for lab, c in zip(self.labels, contrib):
            metrics[f"mix/{lab}_abs_share"] = c / denom if denom > 0 else 0.0
        return CreditOutput(token_advantages=total, loss_mask=union if any_mask else None, metrics=metrics)
