"""Continuing sampled responses from their prefixes: the rollout primitive of Monte-Carlo values
(``gearlab.rollout.mc``) and VinePPO-style credit.

Row n's new prompt is its prompt ⊕ the first ``cuts[n]`` tokens of its response; the engine continues it with seed
``seeds[n]`` starting at draw number ``cuts[n]`` (``TokenGenerator.sample``'s ``step_offset``), for at most the
response budget left (``max_new_tokens - cuts[n]``). With the seed the response was sampled with, HF ``generate``
and the fast decoder therefore continue it with the very draws it was made of: the continuation reproduces the
response, up to the float rounding of a prefill against incremental decoding. With other seeds the continuations
are independent samples of the rest of the response. vLLM continues with fresh draws (its generator cannot start
mid-stream).

Single-turn responses; multi-turn episodes are replayed in a fresh environment up to a turn and continued by
``gearlab.rollout.replay``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from gearlab.rollout.base import SamplingParams, left_pad, stop_token_ids


@torch.no_grad()
def continue_from(engine: Any, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                  response_mask: Tensor, cuts: Sequence[int], sampling: SamplingParams, seeds: Tensor
                  ) -> tuple[Tensor, Tensor]:
    """Continue N responses from their prefixes.

    prompt_ids / prompt_mask [N, P] left-padded; response_ids / response_mask [N, T] right-padded (single-turn: the
    generated tokens); ``cuts[n]`` ≤ row n's response length (≤ ``sampling.max_new_tokens``); seeds [N] int64.
    ``engine`` is a rollout engine (``HFRolloutEngine``: its ``sample_with_logprobs`` and tokenizer).
    Returns (ids [N, T'] = prefix ⊕ continuation, right-padded, mask [N, T'] bool) — whole responses, as the engine
    would have returned them, each at most ``sampling.max_new_tokens`` long and ending at its first stop token."""
    n = prompt_ids.shape[0]
    if len(cuts) != n or seeds.shape != (n,):
        raise ValueError(f"continue_from: {n} rows, {len(cuts)} cuts, seeds of shape {tuple(seeds.shape)}")
    budget = sampling.max_new_tokens
    lengths = response_mask.sum(1).tolist()
    if any(c < 0 or c > min(budget, m) for c, m in zip(cuts, lengths)):
        raise ValueError(f"continue_from: each cut must lie in [0, its response's length], the length at most "
                         f"{budget} (the response budget); got cuts {list(cuts)} for lengths {lengths}")
    pad = engine.tok.pad_token_id
    prefixes = [response_ids[i, : cuts[i]].tolist() for i in range(n)]
    rows = [prompt_ids[i][prompt_mask[i].bool()].tolist() + prefixes[i] for i in range(n)]
    ids, mask = left_pad(rows, pad)
    left = budget - min(cuts)  # one call for all rows; each row is cut back to its own budget below
    out = torch.full((n, budget), pad, dtype=torch.long)
    out_mask = torch.zeros((n, budget), dtype=torch.bool)
    if left > 0:
        sp = replace(sampling, max_new_tokens=left)
        cont, cmask, _ = engine.sample_with_logprobs(model, ids, mask, sp, seeds,
                                                     step_offset=torch.tensor(list(cuts), dtype=torch.long))
    stops = set(stop_token_ids(engine.tok))
    for i in range(n):
        c = cuts[i]
        out[i, :c] = torch.tensor(prefixes[i], dtype=torch.long)
        out_mask[i, :c] = True
        if left > 0 and c < budget and not (prefixes[i] and prefixes[i][-1] in stops):  # a stop ends a response
            m = int(cmask[i].sum())
            k = min(m, budget - c)
            out[i, c : c + k] = cont[i, :k]
            out_mask[i, c : c + k] = True
    width = max(1, int(out_mask.sum(1).max()))
    return out[:, :width], out_mask[:, :width]

