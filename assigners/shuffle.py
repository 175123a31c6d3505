"""``shuffle``: a control that keeps another method's token credit but not where it goes (docs/credit/controls.md).

The inner method (``of``: a registered assigner, a variant of ``conf/assigner/`` or a grid label such as
``gear:q_on=0.8``, with ``of_options`` on top of its own) assigns credit as usual; then, in every row, the token
advantages are permuted among that row's generated positions (``response_mask``). A returned ``loss_mask`` is
permuted with the same permutation, so the effective credit (advantage × loss mask) moves as one.

What it keeps: each row's multiset of token advantages, hence its sum (mass) and signs, and 0 on masked tokens.
What it removes: every link between a token and its credit. A method whose credit is uniform within a row
(``grpo``) is unchanged.

Seeding [PROPOSED]: one ``torch.Generator`` per row, seeded by blake2b(control_seed, the row's real prompt ids,
its real response ids) — ``gearlab.credit.seeding.row_seeds``, shared with GEAR's ``segmentation=random``. The same \
response to the same prompt is
permuted the same way wherever it sits in a batch, whatever the other rows are, and on any device.

Promises, hooks and teacher settings are the inner method's: ``needs``, ``preserves_sign``, ``preserves_mass``,
``requires_turns``, ``keeps_zero_groups`` and ``teacher_*`` are copied from it at construction (the class
attributes describe the default ``of: gear``); ``setup``, ``on_step_end``, ``state_dict``, ``load_state_dict`` and
``signal_options`` are forwarded. Its metrics are reported with the prefix ``inner/``. No ``last_segments``:
after a shuffle, segments mean nothing.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gearlab.core.batch import RolloutBatch
from gearlab.credit import CreditAssigner, CreditOutput, Signal, build, register
from gearlab.credit.methods import method_spec, parse_label
from gearlab.credit.options import OptionError, option, plain
from gearlab.credit.seeding import row_seeds  # noqa: F401 (re-exported for tests and users)


@dataclass
class ShuffleOptions:
    of: str = option(
        "gear", "the method whose token credit is shuffled: a registered assigner, a variant or a grid label"
    )
    # the option kit does not type-check dict fields; ShuffleAssigner checks this one itself
    of_options: dict = option({}, "options on top of the method's own: a mapping, or a string 'key=value,key=value'")
    control_seed: int = option(0, "seed of the per-row permutations, mixed with each row's token ids")


@register("shuffle")
class ShuffleAssigner(CreditAssigner):
    """Control: another method's token advantages, permuted at random within each response."""

    # the class attributes describe the default (of: gear); every instance copies its inner method's
    needs = frozenset({Signal.TEACHER_KL, Signal.ENTROPY})
    preserves_sign = True  # a permutation within a row keeps every value, so both promises are the inner's
    preserves_mass = True

    Options = ShuffleOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        extra = self.of_options
        if isinstance(extra, str):
            try:
                extra = parse_label(f"{self.of}:{extra}")[1] if extra.strip() else {}
            except ValueError as e:
                raise OptionError("assigner.options.of_options", str(e)) from None
        elif isinstance(extra, Mapping):
            extra = plain(extra)
        else:
            raise OptionError("assigner.options.of_options", f"expected a mapping or 'key=value,...', got {extra!r}")
        try:
            spec = method_spec(self.of)
        except (KeyError, ValueError) as e:
            raise OptionError("assigner.options.of", str(e).strip('"')) from None
        if spec.base == self.name:
            raise OptionError("assigner.options.of", f"{self.of!r} is itself a shuffle; shuffle another method")
        try:
            self.inner: CreditAssigner = build(spec.base, {**spec.options, **extra})
        except OptionError as e:  # name the key where it was set: of_options, or the method named by `of`
            key = e.key.rpartition(".")[2]
            where = f"assigner.options.of_options.{key}" if key in extra else "assigner.options.of"
            raise OptionError(where, f"{self.of}: {e.message}") from None
        inner = self.inner
        self.needs = frozenset(inner.needs)
        self.preserves_sign = bool(inner.preserves_sign)
        self.preserves_mass = bool(inner.preserves_mass)
        self.requires_turns = bool(inner.requires_turns)
        self.keeps_zero_groups = bool(inner.keeps_zero_groups)
        self.teacher_mode = inner.teacher_mode
        self.teacher_context = inner.teacher_context
        self.teacher_sync_every = inner.teacher_sync_every
        self.teacher_ema = inner.teacher_ema

    # -- forwarded hooks ----------------------------------------------------------------------
    def signal_options(self) -> dict[str, Any]:
        return self.inner.signal_options()

    def setup(self, *, seed: int, total_steps: int, task: Any) -> None:
        self.inner.setup(seed=seed, total_steps=total_steps, task=task)

    def on_step_end(self, step: int) -> None:
        self.inner.on_step_end(step)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    # -- the control ----------------------------------------------------------------------------
    def source_index(self, batch: RolloutBatch) -> Tensor:
        """[B, T] long on the batch's device: position t of the output takes the inner's value at ``src[i, t]``;
        a permutation of each row's ``response_mask`` positions, the identity elsewhere."""
        mask = batch.response_mask.cpu()
        B, T = mask.shape
        src = torch.arange(T).repeat(B, 1)
        seeds = row_seeds(batch, self.control_seed)
        for i in range(B):
            pos = mask[i].nonzero().flatten()
            if pos.numel() > 1:
                gen = torch.Generator().manual_seed(seeds[i])
                src[i, pos] = pos[torch.randperm(pos.numel(), generator=gen)]
        return src.to(batch.response_mask.device)

    def assign(self, batch: RolloutBatch, seq_advantages: Tensor, signals: dict[Signal, Tensor]) -> CreditOutput:
        out = self.inner.assign(batch, seq_advantages, signals)
        adv = out.token_advantages
        src = self.source_index(batch).to(adv.device)
        loss_mask = None
        if out.loss_mask is not None:
            loss_mask = out.loss_mask.gather(1, src.to(out.loss_mask.device))
        metrics = {f"inner/{k}": v for k, v in out.metrics.items()}
        return CreditOutput(token_advantages=adv.gather(1, src), loss_mask=loss_mask, metrics=metrics)
