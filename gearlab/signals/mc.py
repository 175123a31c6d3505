"""Monte-Carlo values of response prefixes, and the ``mc_step_advantage`` signal built on them.

For a response y to prompt x with steps ending at token positions e_1 < … < e_S (the task's ``step_ends``, mapped to
tokens), the value after step j is V_j = E[r(x, y_≤e_j ⊕ z)], z ~ π(· | x, y_≤e_j), estimated by the mean reward of
``k`` continuations, with its standard error s / √k (s: the sample standard deviation of the k rewards). V_0 is the
value of the prompt alone; V_S, the whole response, is its own reward (no sampling). The step advantage
A_j = V_j − V_{j−1} is VinePPO's credit for step j (arXiv 2410.01679), and the step with the largest drop is where the
response went wrong by this measure: ground truth for credit on any task with a verifier.

Budget: ``max_steps`` keeps the first ``max_steps - 1`` step ends and the last (later steps merge into the final
one), so a response costs at most ``k · max_steps`` continuations.

Sampling the continuations is the rollout layer's job (``gearlab.rollout.mc.PrefixResampler``): this module only sees
a :class:`Resampler`, which the trainer or ``credit-eval`` passes in ``SignalContext.resampler``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import Tensor

from gearlab.signals.registry import SignalContext, register_signal
from gearlab.signals.spans import _tokens_at_chars


MC_SIGNAL = "mc_step_advantage"


class Resampler(Protocol):
    """What Monte-Carlo values need from a rollout engine, for the rows of one batch."""

    def step_ends(self, row: int) -> list[int]:
        """Row ``row``'s step ends as response-token positions (exclusive), the last = its length."""
        ...

    def rewards(self, rows: Sequence[int], cuts: Sequence[int], seeds: Tensor) -> Tensor:
        """Reward [N] float of one continuation of each (row, cut) pair, drawn with ``seeds`` [N] int64."""
        ...


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


def token_step_ends(tokenizer: Any, step_ends: Callable[[str], list[int]], ids: list[int]) -> list[int]:
    """The step ends of the response ``ids`` (generated tokens) as token positions (exclusive): ``step_ends`` gives
    character offsets in its decoded text (``Task.step_ends``); a step ends after the token holding its last
    character; the last end is ``len(ids)``; ends falling in one token merge."""
    if not ids:
        return [0]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    cuts = step_ends(text)[:-1]
    last_tokens = iter(_tokens_at_chars(tokenizer, ids, text, [e - 1 for e in cuts if e > 0]))
    ends: list[int] = []
    for e in cuts:
        k = next(last_tokens) + 1 if e > 0 else 0
        if 0 < k < len(ids) and (not ends or k > ends[-1]):
            ends.append(k)
    return [*ends, len(ids)]


def step_values(resampler: Resampler, rewards: Tensor, *, k: int, max_steps: int, seed: int,
                first_row: int = 0) -> list[StepValues]:
    """Monte-Carlo step values of every row of a batch (``rewards`` [N]: the responses' own). Continuation c from
    point i of row n (i = 0: the prompt, then the interior step ends) draws with seed
    ``seed + ((first_row + n)·max_steps + i)·k + c``: a function of the global row (``first_row``: the global index
    of this batch's row 0), so a row's continuations do not depend on the rows beside it or on the rank."""
    if k < 2 or max_steps < 1:
        raise ValueError(f"Monte-Carlo values need k >= 2 and max_steps >= 1 (got k={k}, max_steps={max_steps})")
    steps: list[list[int]] = []
    points: list[tuple[int, int]] = []  # (row, cut): the prompt alone (cut 0) and each interior step end
    for n in range(rewards.shape[0]):
        ends = resampler.step_ends(n)
        if len(ends) > max_steps:
            ends = [*ends[: max_steps - 1], ends[-1]]
        steps.append(ends)
        points += [(n, 0)] + [(n, e) for e in ends[:-1]]
    rows = [n for n, _ in points for _ in range(k)]
    cuts = [c for _, c in points for _ in range(k)]
    index = [i for n, ends in enumerate(steps) for i in range(len(ends))]  # each point's index within its row
    base = torch.tensor([((first_row + n) * max_steps + i) * k for (n, _), i in zip(points, index)], dtype=torch.long)
    seeds = (base[:, None] + torch.arange(k, dtype=torch.long)).flatten() + seed
    r = resampler.rewards(rows, cuts, seeds).float().view(len(points), k)
    mean, se = r.mean(1), r.std(1, unbiased=True) / math.sqrt(k)
    out: list[StepValues] = []
    p = 0
    for n, ends in enumerate(steps):
        m = len(ends)  # this row's points: the prompt + m - 1 interior ends
        vals, errs = mean[p : p + m].tolist(), se[p : p + m].tolist()
        out.append(StepValues(ends=ends, values=[*vals[1:], float(rewards[n])], stderr=[*errs[1:], 0.0],
                              v0=vals[0], v0_stderr=errs[0]))
        p += m
    return out


def broadcast_steps(values: Sequence[StepValues], response_mask: Tensor) -> Tensor:
    """[B, T] float: each step's advantage A_j on the generated tokens of step j (response_mask's True positions,
    in order), 0 elsewhere."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    for b, sv in enumerate(values):
        pos = response_mask[b].nonzero().flatten().cpu()
        start = 0
        for end, a in zip(sv.ends, sv.advantages):
            out[b, pos[start:end]] = a
            start = end
    return out.to(response_mask.device)


@register_signal(MC_SIGNAL, fake="signed", resamples=True)
def mc_step_advantage(ctx: SignalContext) -> Tensor:
    """VinePPO's step advantage V_j − V_{j−1} from Monte-Carlo continuations, on each step's tokens."""
    if ctx.resampler is None:
        raise ValueError("the mc_step_advantage signal continues responses from their prefixes: it needs a resampler "
                         "(gearlab.rollout.mc.PrefixResampler), which this caller did not give")
    o = ctx.options
    values = step_values(ctx.resampler, ctx.batch.rewards.detach().cpu(), k=int(o.get("mc_k", 8)),
                         max_steps=int(o.get("mc_max_steps", 8)), seed=int(o.get("seed", 0)) + (1 << 40),
                         first_row=int(o.get("first_row", 0)))
    return broadcast_steps(values, ctx.batch.response_mask)
