"""The update's passes: micro-batches by row count or token budget, in order; tiled mini-batches that are the same
passes on any number of ranks; the learning-rate factor per step."""
from __future__ import annotations

import math

import pytest
import torch

from gearlab.trainer.batching import micro_batches, tiled_mini_batches
from gearlab.trainer.schedule import lr_factor


def test_micro_batches_by_token_budget():
    idx = torch.tensor([5, 2, 7, 1, 0])
    lengths = torch.tensor([12, 7, 10, 25, 4])
    assert [c.tolist() for c in micro_batches(idx, lengths, 2)] == [[5, 2], [7, 1], [0]]
    # ≤ 20 real tokens and ≤ 2 rows per micro-batch; a 25-token row goes alone; order kept
    assert [c.tolist() for c in micro_batches(idx, lengths, 2, 20)] == [[5, 2], [7], [1], [0]]
    assert [c.tolist() for c in micro_batches(idx, lengths, 1, 100)] == [[5], [2], [7], [1], [0]]


def test_tiled_mini_batches_partition_the_batch_into_the_same_passes_on_any_rank_count():
    g = torch.Generator().manual_seed(0)
    assert [[c.tolist() for c in mb] for mb in tiled_mini_batches(8, 1, 3, g)] == [[[0, 1, 2], [3, 4, 5], [6, 7]]]
    plan = tiled_mini_batches(32, 2, 4, torch.Generator().manual_seed(3))  # tiles of 8 rows, 4 to each mini-batch
    rows = [r for mb in plan for c in mb for r in c.tolist()]
    assert sorted(rows) == list(range(32))  # a partition
    for mb in plan:
        assert [len(c) for c in mb] == [4, 4, 4, 4]
        assert [sorted({r // 8 for r in c.tolist()}) for c in mb] == [[0], [1], [2], [3]]  # one tile each
    assert plan[0][0].tolist() != sorted(plan[0][0].tolist()) or plan[1][0].tolist() != sorted(plan[1][0].tolist())
    # ranks owning 16 rows each (whole tiles) hold exactly the micro-batches of the whole batch
    for first in (0, 16):
        for mb in plan:
            mine = [c for c in mb if first <= int(c[0]) < first + 16]
            assert all(((c >= first) & (c < first + 16)).all() for c in mine) and len(mine) == 2
    # a last, shorter tile is split as evenly as it goes
    assert [[len(c) for c in mb] for mb in tiled_mini_batches(11, 2, 4, torch.Generator().manual_seed(1))] == [
        [4, 2], [4, 1]]


def test_the_lr_factor_warms_up_linearly_then_decays_to_its_floor():
    """10 steps, 2 of warmup: 0.5 and 1 during warmup; cosine reaches the midpoint of [0.1, 1] halfway through the
    decay and the floor at the end; linear decays by equal steps; constant stays 1."""
    assert [lr_factor(s, 10, 2, "cosine", 0.1) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert lr_factor(6, 10, 2, "cosine", 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(10, 10, 2, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(6, 10, 2, "linear", 0.0) == pytest.approx(0.5)
    assert lr_factor(7, 10, 0, "constant", 0.0) == 1.0
