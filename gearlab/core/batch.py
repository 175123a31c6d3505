"""The rollout record every credit assigner sees.

Layout (verl's): prompts are LEFT-padded to P, responses RIGHT-padded to T, and the model input
is ``cat(prompt_ids, response_ids)`` of length P + T. Every per-token tensor of the RL maths
(log-probs, masks, advantages, turn ids) is indexed over the T response positions only.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor


@dataclass
class RolloutBatch:
    """G sampled responses for each of B/G prompts, with everything the update and the credit
    assigners need.

    Shapes (B sequences, P prompt positions, T response positions):
      prompt_ids      [B, P] long, left-padded
      prompt_mask     [B, P] long/bool, 1 = real prompt token
      response_ids    [B, T] long, right-padded
      response_mask   [B, T] bool, 1 = token the policy generated (0 = padding, tool/env text)
      attention_mask  [B, T] bool, 1 = real response token (policy or env); padding is 0.
                      Equals response_mask on single-turn tasks.
      group_ids       [B] long, one id per prompt; the G samples of a prompt share it
      rewards         [B] float, outcome reward per sequence
      old_logprobs    [B, T] float or None: log π_old of the response tokens
      ref_logprobs    [B, T] float or None: log π_ref, only when a KL term is used
      rollout_logprobs [B, T] float or None: the rollout ENGINE's log-prob of each sampled token (vLLM;
                      0 where response_mask is 0) — differs from old_logprobs by the train/inference mismatch
      turn_ids        [B, T] long or None: turn index of every response token (multi-turn)
      turn_rewards    [B, K] float or None: per-turn rewards (multi-turn)
      teacher_prompt_ids / teacher_prompt_mask [B, P'] or None: the privileged-context prompt
                      (problem + ground truth), left-padded; the teacher sees it ⊕ response_ids
      meta            free-form per-batch data (ground truths, task name, texts); list values
                      have length B
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    group_ids: Tensor
    rewards: Tensor
    attention_mask: Tensor | None = None
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    rollout_logprobs: Tensor | None = None
    turn_ids: Tensor | None = None
    turn_rewards: Tensor | None = None
    teacher_prompt_ids: Tensor | None = None
    teacher_prompt_mask: Tensor | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.attention_mask is None:
            self.attention_mask = self.response_mask.clone()
        self.response_mask = self.response_mask.bool()
        self.attention_mask = self.attention_mask.bool()
        self.validate()

    # -- shapes -----------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.response_ids.shape[0]

    @property
    def response_len(self) -> int:
        return self.response_ids.shape[1]

    def input_ids(self) -> Tensor:
        """[B, P+T] policy input."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    def full_attention_mask(self) -> Tensor:
        """[B, P+T] attention mask of the policy input."""
        return torch.cat([self.prompt_mask.bool(), self.attention_mask], dim=1).long()

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field."""
        B, T = self.response_ids.shape if self.response_ids.dim() == 2 else (None, None)
        if B is None:
            raise ValueError(f"RolloutBatch.response_ids must be [B, T], got {tuple(self.response_ids.shape)}")
        if self.prompt_ids.dim() != 2 or self.prompt_ids.shape[0] != B:
            raise ValueError(f"RolloutBatch.prompt_ids must be [B={B}, P], got {tuple(self.prompt_ids.shape)}")
        if self.prompt_mask.shape != self.prompt_ids.shape:
            raise ValueError("RolloutBatch.prompt_mask must have the shape of prompt_ids")
        for name in ("response_mask", "attention_mask", "old_logprobs", "ref_logprobs", "rollout_logprobs", "turn_ids"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (B, T):
                raise ValueError(f"RolloutBatch.{name} must be [B={B}, T={T}], got {tuple(t.shape)}")
        for name in ("group_ids", "rewards"):
            t = getattr(self, name)
            if tuple(t.shape) != (B,):
                raise ValueError(f"RolloutBatch.{name} must be [B={B}], got {tuple(t.shape)}")
        if (self.response_mask & ~self.attention_mask).any():
            raise ValueError("RolloutBatch.response_mask marks tokens that attention_mask says are padding")
        if self.turn_rewards is not None and (self.turn_rewards.dim() != 2 or self.turn_rewards.shape[0] != B):
            raise ValueError(f"RolloutBatch.turn_rewards must be [B={B}, K], got {tuple(self.turn_rewards.shape)}")
        if (self.teacher_prompt_ids is None) != (self.teacher_prompt_mask is None):
            raise ValueError("RolloutBatch.teacher_prompt_ids and teacher_prompt_mask go together")
        if self.teacher_prompt_ids is not None and self.teacher_prompt_ids.shape[0] != B:
            raise ValueError("RolloutBatch.teacher_prompt_ids must have B rows")
        if not torch.isfinite(self.rewards).all():
            raise ValueError("RolloutBatch.rewards contains a non-finite value")
        for k, v in self.meta.items():
            if isinstance(v, list) and len(v) != B:
                raise ValueError(f"RolloutBatch.meta[{k!r}] has {len(v)} entries for {B} sequences")

    @classmethod
    def from_masks(cls, response_mask: Any, *, rewards: Any = None, group_ids: Any = None, prompt_len: int = 2,
                   **fields: Any) -> "RolloutBatch":
        """A batch for tests and hand-made examples: only the masks (and any other field) matter.

        response_mask [B, T] (nested lists or a tensor); rewards default to 0, group ids to one group;
        token ids are 1. Extra keyword fields (attention_mask, turn_ids, turn_rewards, meta, ...) pass through.
        """
        mask = torch.as_tensor(response_mask, dtype=torch.bool)
        B, T = mask.shape
        return cls(prompt_ids=torch.ones(B, prompt_len, dtype=torch.long), prompt_mask=torch.ones(B, prompt_len,
                   dtype=torch.long),
                   response_ids=torch.ones(B, T, dtype=torch.long), response_mask=mask,
                   group_ids=torch.zeros(B, dtype=torch.long) if group_ids is None else torch.as_tensor(group_ids),
                   rewards=torch.zeros(B) if rewards is None else torch.as_tensor(rewards, dtype=torch.float32),
                   **fields)

    def select(self, idx: Tensor) -> "RolloutBatch":
        """The sub-batch of rows ``idx`` (a 1-D long tensor); meta lists are indexed too."""
        out = {}
        for name in self.__dataclass_fields__:
            v = getattr(self, name)
            if isinstance(v, Tensor):
                out[name] = v[idx]
            elif name == "meta":
                out[name] = {
                    k: ([val[i] for i in idx.tolist()] if isinstance(val, list) else val) for k, val in v.items()
                }
            else:
                out[name] = v
        return RolloutBatch(**out)

    def cropped(self) -> "RolloutBatch":
        """The same rows without the prompt columns that are padding in every row (left; the teacher's prompt too) and
        the response columns that are padding in every row (right): [B, P'] and [B, T'] with P' ≤ P, T' ≤ T (at
        least one column each).
        Positions come from the masks, so every real token's log-prob is unchanged; a micro-batch of short
        responses then costs its own length, not the whole batch's longest."""
        real_p = self.prompt_mask.bool().any(0).nonzero()
        real_t = self.attention_mask.any(0).nonzero()
        p0 = int(real_p[0]) if real_p.numel() else self.prompt_ids.shape[1] - 1
        t1 = int(real_t[-1]) + 1 if real_t.numel() else 1
        if p0 == 0 and t1 == self.response_len:
            return self
        changes: dict[str, Any] = {"prompt_ids": self.prompt_ids[:, p0:], "prompt_mask": self.prompt_mask[:, p0:]}
        for name in ("response_ids", "response_mask", "attention_mask", "old_logprobs", "ref_logprobs",
                     "rollout_logprobs", "turn_ids"):
            t = getattr(self, name)
            changes[name] = t[:, :t1] if t is not None else None
        if self.teacher_prompt_mask is not None:  # the privileged prompt is left-padded too
            real_q = self.teacher_prompt_mask.bool().any(0).nonzero()
            q0 = int(real_q[0]) if real_q.numel() else self.teacher_prompt_ids.shape[1] - 1
            changes.update(teacher_prompt_ids=self.teacher_prompt_ids[:, q0:],
                           teacher_prompt_mask=self.teacher_prompt_mask[:, q0:])
        return replace(self, **changes)

    def to(self, device: torch.device | str) -> "RolloutBatch":
        """A copy with every tensor field on ``device`` (this batch itself on a CPU-only target it is already on)."""
        device = torch.device(device)
        tensors = {k: v for k, v in vars(self).items() if isinstance(v, Tensor)}
        if all(v.device == device for v in tensors.values()):
            return self
        return replace(self, **{k: v.to(device) for k, v in tensors.items()})

    def with_(self, **changes: Any) -> "RolloutBatch":
        """A copy with some fields replaced (validated again)."""
        return replace(self, **changes)
