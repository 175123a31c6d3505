"""Prompt stream for RL iterations, resumable at any iteration.

Iteration i uses a deterministic slice of a seeded permutation of the task's train pool, so the
data order is a function of (seed, i) alone: a resumed run sees exactly the prompts an
uninterrupted one would, and every run of a paired comparison sees the same prompts.
"""
from __future__ import annotations

from typing import Any, Iterator

import lightning as L
import torch

from gearlab.tasks.base import Problem, Task


class ProblemBatch:
    """One iteration's prompts, opaque to Lightning's batch utilities: they walk lists and dataclasses, and a
    precision plugin's input conversion (FSDP1 with bf16-mixed, any bf16-true) would try to rewrite the
    fields of the frozen ``Problem`` records. Iterable and sized like the list it holds."""

    __slots__ = ("items",)

    def __init__(self, items: Any) -> None:
        self.items = list(items)

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Problem]:
        return iter(self.items)

    def __getitem__(self, i: int) -> Problem:
        return self.items[i]


class StepStream:
    """Iterable of per-iteration batches ``{"iteration": i, "problems": [...]}`` for i in [start, total).

    ``len()`` is the total number of iterations (Lightning restores how many were consumed and
    counts from there, so the length must not shrink on resume).
    """

    def __init__(self, dm: "PromptDataModule", start: int, total: int) -> None:
        self.dm, self.start, self.total = dm, start, total

    def __len__(self) -> int:
        return self.total

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(self.start, self.total):
            yield {"iteration": i, "problems": ProblemBatch(self.dm.step_problems(i))}


class PromptDataModule(L.LightningDataModule):
    def __init__(self, task: Task, *, prompts_per_step: int, num_steps: int, seed: int, pool_size: int = 4096) -> None:
        super().__init__()
        self.task = task
        self.prompts_per_step = prompts_per_step
        self.num_steps = num_steps
        self.seed = seed
        self.pool_size = pool_size
        self.start_iteration = 0
        self._pool: list[Problem] | None = None

    @property
    def pool(self) -> list[Problem]:
        if self._pool is None:
            self._pool = self.task.problems("train", self.pool_size, self.seed)
            if not self._pool:
                raise ValueError(f"task {self.task.name!r} returned no training problems")
        return self._pool

    def _perm(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 10_007 + epoch)
        return torch.randperm(len(self.pool), generator=g).tolist()

    def step_problems(self, iteration: int) -> list[Problem]:
        """This rank's prompts for ``iteration`` (the global batch is split across data-parallel ranks)."""
        world, rank = 1, 0
        if self.trainer is not None:
            world, rank = self.trainer.world_size, self.trainer.global_rank
        if self.prompts_per_step % world:
            raise ValueError(f"rollout.prompts_per_step={self.prompts_per_step} is not divisible by the {world} ranks")
        n = len(self.pool)
        out, perms = [], {}
        for j in range(iteration * self.prompts_per_step, (iteration + 1) * self.prompts_per_step):
            epoch, pos = divmod(j, n)
            if epoch not in perms:
                perms[epoch] = self._perm(epoch)
            out.append(self.pool[perms[epoch][pos]])
        per_rank = self.prompts_per_step // world
        return out[rank * per_rank : (rank + 1) * per_rank]

    def train_dataloader(self) -> StepStream:
        return StepStream(self, self.start_iteration, self.num_steps)

    def state_dict(self) -> dict[str, Any]:
        done = getattr(self.trainer.lightning_module, "iterations_done", 0) if self.trainer is not None else 0
        return {"next_iteration": int(done)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.start_iteration = int(state.get("next_iteration", 0))
