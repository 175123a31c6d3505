"""What every rollout engine shares: the sampling settings, the engine and token-generator protocols, the per-step
seeds, stop tokens and the prompt padding helpers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor, nn

from gearlab.core.batch import RolloutBatch
from gearlab.tasks.base import Problem


@dataclass
class SamplingParams:
    max_new_tokens: int = 48
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False

    def __post_init__(self) -> None:
        # logits / 0 are ±inf and their softmax NaN: the fast sampler's inverse CDF then returns an id past the
        # vocabulary, and the next step's embedding lookup fails on the GPU far from the cause
        if self.temperature <= 0 and not self.greedy:
            raise ValueError(f"SamplingParams: temperature {self.temperature} needs greedy=True (argmax decoding)")

    @classmethod
    def of_rollout(cls, rollout: Any) -> "SamplingParams":
        """The sampling settings of a config's ``rollout`` section (what a training rollout draws with)."""
        return cls(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature, top_p=rollout.top_p,
                   top_k=rollout.top_k)


@dataclass
class RewardStats:
    errors: int = 0


class RolloutEngine(Protocol):
    def generate(self, model: nn.Module, problems: Sequence[Problem], *, group_size: int, sampling: SamplingParams,
                 seed: int, with_teacher: bool = False) -> RolloutBatch: ...


@runtime_checkable
class TokenGenerator(Protocol):
    """An inference engine that turns prompt ids into sampled ids, used instead of HF ``generate`` on the policy
    (``gearlab.rollout.vllm.VLLMGenerator``). The single- and multi-turn engines call ``sample``; the trainer
    calls the other three around each iteration. Every method here is called: an engine implements all four."""

    def sample(self, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, sampling: SamplingParams,
               seed: int, step_offset: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """Left-padded prompts [N, P] → (response ids [N, T] right-padded, mask [N, T] bool, the engine's
        log-probs of the sampled tokens [N, T] float32 or None). ``step_offset`` [N] int64 (None = 0): row i's first
        new token is draw number ``step_offset[i]`` of its seed's stream — a prompt that ends with the first
        ``step_offset[i]`` tokens of a response continues it with the draws the whole response was sampled with
        (``gearlab.rollout.continuation``). An engine whose sampler is not gearlab's (vLLM) draws fresh samples."""
        ...

    def release(self) -> None:
        """After the rollout, before the update: give back what the update needs (e.g. sleep, freeing GPU memory)."""
        ...

    def mark_stale(self) -> None:
        """After an optimizer step: the policy's weights changed; sync them before the next ``sample``."""
        ...

    def stats(self) -> dict[str, float]:
        """Metrics of the last weight sync / rollout, logged with the iteration (e.g. ``vllm/weight_sync_s``)."""
        ...


def step_seed(base_seed: int, step: int, rank: int = 0) -> int:
    """A distinct, reproducible seed per (run seed, step, rank)."""
    return (base_seed * 1_000_003 + step * 7919 + rank * 104_729) % (2**63 - 1)


def row_seeds(seed: int | Tensor, n: int) -> Tensor:
    """Per-row sampling seeds [n] int64 of one engine call: ``seed + i`` for row i when ``seed`` is an int, else the
    given [n] tensor (e.g. multi-turn: the seeds of the episodes still active). The trainer folds the global index of
    a rank's first row into ``seed``, so a row's sample depends on its global row, never on how many ranks share
    the batch."""
    if isinstance(seed, Tensor):
        if seed.shape != (n,):
            raise ValueError(f"per-row seeds of shape {tuple(seed.shape)} for {n} rows")
        return seed.to(torch.int64).cpu() % (2**63 - 1)
    return (seed + torch.arange(n, dtype=torch.int64)) % (2**63 - 1)


STATIC_PAD = 64


def stop_token_ids(tokenizer) -> list[int]:
    """Token ids that end a response: the tokenizer's EOS and the ChatML end tokens it knows."""
    ids = {tokenizer.eos_token_id}
    for name in ("<|im_end|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(name)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return sorted(i for i in ids if i is not None)


def idle_prompt(prompt_ids: Tensor, pad_id: int) -> Tensor:
    """One prompt row for a rank with nothing to generate (a real row if there is one)."""
    return prompt_ids[:1] if prompt_ids.shape[0] else torch.full((1, 1), pad_id, dtype=torch.long)


def pad_left_to(ids: Tensor, mask: Tensor, multiple: int, pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad [N, P] prompts to the next multiple of ``multiple`` positions (masked: same samples)."""
    extra = -ids.shape[1] % multiple
    if not extra:
        return ids, mask
    return (torch.nn.functional.pad(ids, (extra, 0), value=pad_id), torch.nn.functional.pad(mask, (extra, 0), value=0))


def trim_left(ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Drop the leading columns of left-padded prompts [N, P] that are padding in every row: a generate call's
    prompts padded to its own longest, so the shapes a chunk of rows decodes with depend on those rows only, not
    on the rows beside them on this rank (on GPUs kernels are chosen by shape: the world-size guarantee)."""
    filled = mask.bool().any(0)
    if not filled.any():
        return ids, mask
    first = int(filled.nonzero()[0])
    return ids[:, first:], mask[:, first:]


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids, mask


# SDPO's teacher context (TRL's SDPOConfig defaults: reprompt_template and solution_template, no feedback)
SIBLING_TEMPLATE = "{prompt}\nCorrect solution:\n\n{solution}\n\n\n\nCorrectly solve the original question.\n"


def sibling_demonstrations(rewards: Tensor, group_ids: Tensor) -> list[int | None]:
    """For each row: the first other row of its group (in batch order) whose reward is at least 1, or None (TRL's
    ``success_reward_threshold=1.0`` and ``dont_reprompt_on_self_success``)."""
    ok = (rewards.detach().float().cpu() >= 1.0).tolist()
    groups = group_ids.detach().cpu().tolist()
    solved: dict[int, list[int]] = {}  # group → its first two solved rows, in batch order (one pass, not B²)
    for j, (g, okj) in enumerate(zip(groups, ok)):
        if okj and len(solved.setdefault(g, [])) < 2:
            solved[g].append(j)
    return [next((j for j in solved.get(g, []) if j != i), None) for i, g in enumerate(groups)]


def sibling_reprompt(prompt: str, solution: str) -> str:
    """The teacher's user message: the question, then a correct response of the group as a worked solution."""
    return SIBLING_TEMPLATE.format(prompt=prompt, solution=solution)

