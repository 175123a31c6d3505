"""The weights behind the teacher signals, by the assigner's ``teacher_mode``.

live   — the policy itself (no copy; what OPSD/GEAR's default reading uses);
frozen — a copy of the policy, re-synced every ``teacher_sync_every`` iterations (0 = never; RLSD);
ema    — an exponential moving average of the policy weights, decay ``teacher_ema``.
The privileged context (answer / solution) is a prompt matter, handled by the rollout engine.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from gearlab.credit import CreditAssigner, Signal

TEACHER_SIGNALS = frozenset({Signal.TEACHER_LOGPROBS, Signal.TEACHER_KL, Signal.TEACHER_ENTROPY})


def needs_teacher(assigner: CreditAssigner) -> bool:
    return bool(frozenset(assigner.needs) & TEACHER_SIGNALS)


class Teacher:
    def __init__(self, policy: nn.Module, assigner: CreditAssigner) -> None:
        self.mode = getattr(assigner, "teacher_mode", "live")
        if self.mode not in ("live", "frozen", "ema"):
            raise ValueError(f"teacher_mode must be live, frozen or ema, got {self.mode!r}")
        self.sync_every = int(getattr(assigner, "teacher_sync_every", 0))
        self.decay = float(getattr(assigner, "teacher_ema", 0.99))
        self.policy = policy
        self.copy: nn.Module | None = None
        if self.mode != "live" and needs_teacher(assigner):
            self.copy = copy.deepcopy(policy).eval().requires_grad_(False)

    def _follow_policy(self) -> None:
        # the copy is made when the LightningModule is built, before Lightning moves the policy to its device;
        # it is not a registered submodule, so it follows here (a GPU run otherwise computes the teacher on CPU
        # weights and fails on the first teacher forward)
        p = next(self.policy.parameters(), None)
        t = next(self.copy.parameters(), None)
        if p is not None and t is not None and t.device != p.device:
            self.copy.to(p.device)

    @property
    def model(self) -> nn.Module | None:
        """The teacher network, or None for the live policy; on the policy's device."""
        if self.copy is not None:
            self._follow_policy()
        return self.copy

    @torch.no_grad()
    def after_iteration(self, iterations_done: int) -> None:
        """Update the copy after an iteration's optimizer steps."""
        if self.copy is None:
            return
        self._follow_policy()
        if self.mode == "frozen":
            if self.sync_every > 0 and iterations_done % self.sync_every == 0:
                self.copy.load_state_dict(self.policy.state_dict())
        else:
            for t, p in zip(self.copy.parameters(), self.policy.parameters()):
                t.lerp_(p.detach().to(t.dtype), 1.0 - self.decay)

    def state_dict(self) -> dict | None:
        return None if self.copy is None else self.copy.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        if self.copy is not None and state is not None:
            self.copy.load_state_dict(state)
