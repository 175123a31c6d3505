"""Monte-Carlo values through a rollout engine: :class:`PrefixResampler` continues a batch's responses from their
prefixes (``gearlab.rollout.continuation``) and scores the continuations with the task's verifier, which is what
``gearlab.signals.mc`` (the values, the ``mc_step_advantage`` signal) asks of a rollout engine. Single-turn tasks
only.
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

    @classmethod
    def of_groups(cls, engine: Any, model: nn.Module, rb: Any, problems: Sequence[Problem], group_size: int,
                  sampling: SamplingParams) -> "PrefixResampler":
        """The resampler of a rollout batch ``rb`` of ``group_size`` responses per problem (``problems``: one per
        group, in row order)."""
        rows = [p for p in problems for _ in range(group_size)]
        return cls(engine, model, rows, rb.prompt_ids, rb.prompt_mask, rb.response_ids, rb.response_mask, sampling)

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


def mc_values(engine: Any, model: nn.Module, problems: Sequence[Problem], prompt_ids: Tensor, prompt_mask: Tensor,
              response_ids: Tensor, response_mask: Tensor, rewards: Tensor, *, k: int, max_steps: int,
              sampling: SamplingParams, seed: int) -> tuple[list[StepValues], dict[str, float]]:
    """Monte-Carlo step values of N single-turn responses (one ``Problem`` per row, rows as a ``RolloutBatch``
    holds them, ``rewards`` [N] their own) and what they cost: ``gearlab.signals.mc.step_values`` through a
    :class:`PrefixResampler`."""
    rs = PrefixResampler(engine, model, problems, prompt_ids, prompt_mask, response_ids, response_mask, sampling)
    return step_values(rs, rewards, k=k, max_steps=max_steps, seed=seed), rs.cost
