"""The environment interface of multi-turn tasks.

An episode: ``obs0 = env.reset()`` is shown to the policy as the prompt; each turn the policy writes
an action (text), ``env.step(action)`` answers with the next observation (tool output, feedback), the
turn's intermediate reward, whether the episode is over, and an info dict. When the episode ends —
because the environment said so, or the rollout loop's turn or token budget ran out — the outcome
reward is ``env.outcome()``.

Reward convention (the one the turn-level assigners read, ``assigners/mt_grpo.py``):
``StepResult.reward`` is the INTERMEDIATE reward of that turn only; the outcome reward is separate
(``outcome()``), so nothing is counted twice. A turn the loop cut short (no complete action) is never
stepped and gets turn reward 0.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StepResult", "Environment"]


@dataclass
class StepResult:
    """What ``Environment.step`` returns.

    observation: text shown to the policy before its next turn ("" if none); ignored when done
    reward:      intermediate reward of this turn (not the outcome)
    done:        the episode is over (the policy gave a final answer, or can no longer act)
    info:        free-form; keys the rollout loop reads: ``tool_call`` (bool, the action called a
                 tool), ``valid_call`` (bool, the call parsed and ran), ``correct`` (bool, the call
                 made progress), ``finished`` (bool, a final answer was given), ``anchor`` (hashable
                 state key for GiGPO step groups; default: the observation text)
    """

    observation: str
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment(ABC):
    """One episode of a multi-turn task. Instances are used once (``reset`` then ``step``s)."""

    @abstractmethod
    def reset(self) -> str:
        """Start the episode; return the first observation (the user message the policy sees)."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply the policy's action (its decoded turn, without the end-of-turn token)."""

    @abstractmethod
    def outcome(self) -> float:
        """Outcome reward of the episode so far (called once when it ends, however it ended)."""
