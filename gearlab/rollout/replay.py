"""Multi-turn episodes replayed up to a turn, and continued from there: Monte-Carlo values of multi-turn responses.

A multi-turn prefix is not just tokens: the environment's state after those turns is part of it. :func:`replay`
rebuilds it by stepping a fresh environment with the episode's own actions (each turn's generated tokens, decoded as
the rollout decoded them) and checks that every observation it answers is the token sequence the episode recorded; an
environment that answers otherwise cannot be replayed, and :class:`ReplayMismatch` says where. The embedded tool
environments are deterministic.

:class:`EpisodeResampler` is the ``gearlab.signals.mc.Resampler`` of a multi-turn batch: its steps are turns (a
step ends with the last generated token of a turn; the environment's answer belongs to the prefix of the next
step), and it continues each (row, turn) with ``MultiTurnRolloutEngine.rollout(start=...)``. Given an episode's own
seed, the continuation reproduces the episode: every turn draws with ``seed + 1_000_003 · (turn + 1)`` whatever
turn it starts from.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from gearlab.rollout.base import SamplingParams
from gearlab.rollout.multiturn import Episode, MultiTurnRolloutEngine
from gearlab.tasks.base import Problem

__all__ = ["ReplayMismatch", "episode_turns", "replay", "EpisodeResampler"]


class ReplayMismatch(ValueError):
    """The environment answered a replayed action otherwise than in the episode: this task cannot be replayed."""


def episode_turns(response_ids: Tensor, response_mask: Tensor, turn_ids: Tensor, attention_mask: Tensor
                  ) -> list[list[int]]:
    """One episode's generated tokens per turn (each ending with its end-of-turn token when the turn completed).
    Inputs: one row [T] of a multi-turn ``RolloutBatch``: response ids, generated mask, turn ids, real-token mask."""
    real = attention_mask.bool()
    gen, tid, ids = response_mask.bool()[real], turn_ids[real], response_ids[real]
    n_turns = int(tid[gen].max()) + 1 if bool(gen.any()) else 0
    return [ids[gen & (tid == k)].tolist() for k in range(n_turns)]


def replay(engine: MultiTurnRolloutEngine, problem: Problem, prompt: list[int], turns: Sequence[list[int]],
           recorded: list[int], n_turns: int, sampling: SamplingParams, index: int) -> Episode:
    """The episode of ``problem`` after its first ``n_turns`` turns, its environment stepped with their actions.

    ``prompt``: the episode's prompt ids; ``turns``: its generated tokens per turn (:func:`episode_turns`);
    ``recorded``: its whole response (generated and environment tokens, unpadded); ``index``: the row whose seed the
    continuation draws with. Raises :class:`ReplayMismatch` when the rebuilt tokens differ from ``recorded``."""
    e = engine.new_episode(problem, index, prompt=prompt)
    budget = engine.episode_budget(sampling)
    for k in range(n_turns):
        toks = list(turns[k])
        e.append(toks, True, k)
        e.turn_rewards.append(0.0)
        action = engine.tok.decode(toks[:-1], skip_special_tokens=True)
        engine._apply(e, engine._step(e, action), k, budget)
        if e.end_reason is not None:
            raise ReplayMismatch(f"task {engine.task.name!r}: replaying turn {k + 1} of an episode ended it "
                                 f"({e.end_reason}), which the episode went on after: it cannot be replayed")
    if e.tokens != recorded[: len(e.tokens)]:
        at = next(i for i, (a, b) in enumerate(zip(e.tokens, recorded)) if a != b) if e.tokens else 0
        raise ReplayMismatch(f"task {engine.task.name!r}: its environment answered a replayed action otherwise "
                             f"(response token {at} differs): its episodes cannot be replayed")
    return e


@dataclass
class EpisodeResampler:
    """The Monte-Carlo resampler of a multi-turn batch ``rb`` (``problems``: one per row): steps are turns."""

    engine: MultiTurnRolloutEngine
    model: nn.Module
    problems: Sequence[Problem]
    rb: Any
    sampling: SamplingParams
    cost: dict[str, float] = field(default_factory=lambda: {"continuations": 0, "tokens": 0, "seconds": 0.0})

    def __post_init__(self) -> None:
        cpu = lambda t: t.detach().cpu()  # noqa: E731
        rb = self.rb
        self._turns = [episode_turns(cpu(rb.response_ids[n]), cpu(rb.response_mask[n]), cpu(rb.turn_ids[n]),
                                     cpu(rb.attention_mask[n])) for n in range(rb.batch_size)]
        self._prompts = [cpu(rb.prompt_ids[n])[cpu(rb.prompt_mask[n]).bool()].tolist() for n in range(rb.batch_size)]
        self._recorded = [cpu(rb.response_ids[n])[cpu(rb.attention_mask[n]).bool()].tolist()
                          for n in range(rb.batch_size)]

    def step_ends(self, row: int) -> list[int]:
        """Cumulative generated tokens at the end of each turn (the last = the row's generated length)."""
        ends, n = [], 0
        for toks in self._turns[row]:
            n += len(toks)
            ends.append(n)
        return ends or [0]

    @torch.no_grad()
    def continue_episodes(self, rows: Sequence[int], cuts: Sequence[int], seeds: Tensor) -> list[Episode]:
        """One continuation per (row, cut): the episode replayed to the turn ending at ``cut`` generated tokens (0:
        the prompt alone), then rolled out to its end, drawing with ``seeds`` [N] int64 (the episode's own seed
        reproduces it)."""
        starts = []
        for i, (n, c) in enumerate(zip(rows, cuts)):
            ends = [0, *self.step_ends(n)]
            if c not in ends:
                raise ValueError(f"row {n}: cut {c} is not a turn end ({ends})")
            starts.append(replay(self.engine, self.problems[n], self._prompts[n], self._turns[n], self._recorded[n],
                                 ends.index(c), self.sampling, i))
        return self.engine.rollout(self.model, [], self.sampling, seeds, start=starts)

    def rewards(self, rows: Sequence[int], cuts: Sequence[int], seeds: Tensor) -> Tensor:
        """The environment's outcome of one continuation per (row, cut) (:meth:`continue_episodes`)."""
        t0 = time.perf_counter()
        done = self.continue_episodes(rows, cuts, seeds)
        r = torch.tensor([self.engine.guarded_reward(e.env.outcome)[0] for e in done], dtype=torch.float32)
        self.cost["continuations"] += len(rows)
        self.cost["tokens"] += sum(sum(e.generated) for e in done) - sum(cuts)
        self.cost["seconds"] += time.perf_counter() - t0
        return r
