"""Monte-Carlo values through a rollout engine: :class:`PrefixResampler` continues a batch's responses from their
prefixes (``gearlab.rollout.continuation``) and scores the continuations with the task's verifier, which is what
``gearlab.signals.mc`` (the values, the ``mc_step_advantage`` signal) asks of a rollout engine. Multi-turn batches
take ``gearlab.rollout.replay.EpisodeResampler`` (steps are turns); :func:`resampler_of_groups` picks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from gearlab.rollout.base import SamplingParams
from gearlab.rollout.continuation import continue_from
from gearlab.signals.mc import StepValues, step_values, token_step_ends
from gearlab.tasks.base import Problem


@dataclass
class PrefixResampler:
    """The ``gearlab.signals.mc.Resampler`` of one single-turn batch: ``engine`` (an ``HFRolloutEngine``, any
    token generator behind it), the policy, one ``Problem`` per row, the batch's prompts [N, P] and responses [N, T],
    and the sampling settings the responses were drawn with. Counts what it costs (``continuations``, generated
    ``tokens``, ``seconds``)."""

    engine: Any
    model: nn.Module
    problems: Sequence[Problem]
    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    sampling: SamplingParams
    cost: dict[str, float] = field(default_factory=lambda: {"continuations": 0, "tokens": 0, "seconds": 0.0})

    def step_ends(self, row: int) -> list[int]:
        ids = self.response_ids[row][self.response_mask[row].bool()].tolist()
        return token_step_ends(self.engine.tok, self.engine.task.step_ends, ids)

    @torch.no_grad()
    def rewards(self, rows: Sequence[int], cuts: Sequence[int], seeds: Tensor) -> Tensor:
        t0 = time.perf_counter()
        rows = list(rows)
        cpu = lambda t: t.detach().cpu()  # noqa: E731
        cont, cmask = continue_from(self.engine, self.model, cpu(self.prompt_ids)[rows], cpu(self.prompt_mask)[rows],
                                    cpu(self.response_ids)[rows], cpu(self.response_mask)[rows], cuts, self.sampling,
                                    seeds)
        tok = self.engine.tok
        texts = tok.batch_decode(cont.masked_fill(~cmask, tok.pad_token_id), skip_special_tokens=True)
        r = self.engine.score([self.problems[n] for n in rows], texts).float()
        self.cost["continuations"] += len(rows)
        self.cost["tokens"] += int(cmask.sum()) - sum(cuts)
        self.cost["seconds"] += time.perf_counter() - t0
        return r


def resampler_of_rows(engine: Any, model: nn.Module, rb: Any, rows: Sequence[Problem], sampling: SamplingParams
                      ) -> Any:
    """The resampler of a rollout batch ``rb`` (``rows``: one Problem per row): an ``EpisodeResampler`` (steps are
    turns) for a multi-turn engine, else a :class:`PrefixResampler`."""
    from gearlab.rollout.multiturn import MultiTurnRolloutEngine

    if isinstance(engine, MultiTurnRolloutEngine):
        from gearlab.rollout.replay import EpisodeResampler

        return EpisodeResampler(engine, model, rows, rb, sampling)
    return PrefixResampler(engine, model, rows, rb.prompt_ids, rb.prompt_mask, rb.response_ids, rb.response_mask,
                           sampling)


def resampler_of_groups(engine: Any, model: nn.Module, rb: Any, problems: Sequence[Problem], group_size: int,
                        sampling: SamplingParams) -> Any:
    """:func:`resampler_of_rows` for a batch of ``group_size`` responses per problem (``problems``: one per group,
    in row order)."""
    return resampler_of_rows(engine, model, rb, [p for p in problems for _ in range(group_size)], sampling)


def mc_values(engine: Any, model: nn.Module, rows: Sequence[Problem], rb: Any, *, k: int, max_steps: int,
              sampling: SamplingParams, seed: int) -> tuple[list[StepValues], dict[str, float]]:
    """Monte-Carlo step values of the responses of a rollout batch ``rb`` (``rows``: one Problem per row; its
    ``rewards`` [N] the responses' own) and what they cost: ``gearlab.signals.mc.step_values`` through
    :func:`resampler_of_rows`."""
    rs = resampler_of_rows(engine, model, rb, rows, sampling)
    return step_values(rs, rb.rewards, k=k, max_steps=max_steps, seed=seed), rs.cost
