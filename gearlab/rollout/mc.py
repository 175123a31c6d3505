"""Monte-Carlo values of response prefixes: how often a response still succeeds when continued from a point.

For a response y to prompt x with steps ending at token positions e_1 < … < e_S (``Task.step_ends``, mapped to
tokens), the value after step j is V_j = E[r(x, y_≤e_j ⊕ z)], z ~ π(· | x, y_≤e_j), estimated by the mean reward of
``k`` continuations (``gearlab.rollout.continuation``), with its standard error s / √k (s: the sample standard
deviation of the k rewards). V_0 is the value of the prompt alone; V_S, the whole response, is its own reward
(no sampling). The step advantage A_j = V_j − V_{j−1} is VinePPO's (arXiv 2410.01679) credit for step j, and the
step with the largest drop is where the response went wrong by this measure — ground truth for credit on any task
with a verifier.

Budget: ``max_steps`` keeps the first ``max_steps - 1`` step ends and the last (later steps merge into the final
one), so a response costs at most ``k · max_steps`` continuations. The cost (continuations, generated tokens,
seconds) is returned with the values.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from gearlab.rollout.base import SamplingParams
from gearlab.rollout.continuation import continue_from
from gearlab.signals.spans import _char_starts, _token_at_char
from gearlab.tasks.base import Problem, Task


@dataclass
class StepValues:
    """One response's steps and values. ``ends[j]``: the response-token position (exclusive) where step j+1 ends,
    the last = the response length. ``values[j]`` / ``stderr[j]``: V after step j+1; ``v0`` / ``v0_stderr``: V of
    the prompt alone."""

    ends: list[int]
    values: list[float]
    stderr: list[float]
    v0: float
    v0_stderr: float

    @property
    def advantages(self) -> list[float]:
        """A_j = V_j − V_{j−1}, one per step (the first against V_0)."""
        prev = [self.v0, *self.values[:-1]]
        return [v - p for v, p in zip(self.values, prev)]

    @property
    def onset(self) -> int:
        """Index of the step with the largest value drop (the first on ties): where the response went wrong."""
        adv = self.advantages
        return min(range(len(adv)), key=lambda j: (adv[j], j))


@dataclass
class MCCost:
    continuations: int = 0
    tokens: int = 0  # generated tokens, the prefixes not counted
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


def token_step_ends(tokenizer: Any, task: Task, ids: list[int]) -> list[int]:
    """The task's step ends of the response ``ids`` (generated tokens only), as token positions (exclusive):
    a step ends after the token holding its last character; the last end is ``len(ids)``; duplicates merge."""
    if not ids:
        return [0]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    starts = _char_starts(tokenizer, ids, text)
    ends: list[int] = []
    for e in task.step_ends(text)[:-1]:
        k = _token_at_char(tokenizer, ids, starts, e - 1) + 1 if e > 0 else 0
        if 0 < k < len(ids) and (not ends or k > ends[-1]):
            ends.append(k)
    return [*ends, len(ids)]


@torch.no_grad()
def mc_values(engine: Any, model: nn.Module, problems: Sequence[Problem], prompt_ids: Tensor, prompt_mask: Tensor,
              response_ids: Tensor, response_mask: Tensor, rewards: Tensor, *, k: int, max_steps: int,
              sampling: SamplingParams, seed: int) -> tuple[list[StepValues], MCCost]:
    """Monte-Carlo step values of N single-turn responses (one ``Problem`` per row; rows as a ``RolloutBatch`` holds
    them: prompts [N, P] left-padded, responses [N, T] right-padded, their rewards [N]). ``k`` ≥ 2 continuations
    per point; continuation c of point p draws with seed ``seed + p·k + c``. Returns one :class:`StepValues` per row
    and the cost."""
    if k < 2 or max_steps < 1:
        raise ValueError(f"mc_values: k must be >= 2 and max_steps >= 1 (got k={k}, max_steps={max_steps})")
    t0 = time.perf_counter()
    tok = engine.tok
    steps: list[list[int]] = []
    points: list[tuple[int, int]] = []  # (row, cut): the prompt alone (cut 0) and each interior step end
    for n in range(len(problems)):
        ids = response_ids[n][response_mask[n].bool()].tolist()
        ends = token_step_ends(tok, engine.task, ids)
        if len(ends) > max_steps:
            ends = [*ends[: max_steps - 1], ends[-1]]
        steps.append(ends)
        points += [(n, 0)] + [(n, e) for e in ends[:-1]]
    rows = [n for n, _ in points for _ in range(k)]
    cuts = [c for _, c in points for _ in range(k)]
    seeds = torch.arange(len(rows), dtype=torch.long) + seed
    cont, cmask = continue_from(engine, model, prompt_ids[rows], prompt_mask[rows], response_ids[rows],
                                response_mask[rows], cuts, sampling, seeds)
    texts = tok.batch_decode(cont.masked_fill(~cmask, tok.pad_token_id), skip_special_tokens=True)
    r = engine.score([problems[n] for n in rows], texts).float().view(len(points), k)
    mean, se = r.mean(1), r.std(1, unbiased=True) / math.sqrt(k)
    out: list[StepValues] = []
    p = 0
    for n, ends in enumerate(steps):
        m = len(ends)  # points of this row: the prompt + m - 1 interior ends
        vals, errs = mean[p : p + m].tolist(), se[p : p + m].tolist()
        out.append(StepValues(ends=ends, values=[*vals[1:], float(rewards[n])], stderr=[*errs[1:], 0.0],
                              v0=vals[0], v0_stderr=errs[0]))
        p += m
    generated = int(cmask.sum()) - sum(cuts)
    return out, MCCost(continuations=len(rows), tokens=generated, seconds=time.perf_counter() - t0)
