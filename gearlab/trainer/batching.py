"""How an optimizer step's rows are cut into the passes of the update: mini-batches and micro-batches."""
from __future__ import annotations

import torch
from torch import Tensor


def tiled_mini_batches(n_rows: int, mini_batches: int, micro: int, generator: torch.Generator) -> list[list[Tensor]]:
    """The rows 0..n_rows-1 of a global batch as ``mini_batches`` mini-batches, each a list of micro-batches (global
    row ids [≤ micro] int64): the rows are cut into consecutive tiles of ``micro × mini_batches`` rows, and a seeded
    permutation of each tile gives every mini-batch ``micro`` of its rows, one micro-batch (a last, shorter tile is
    split as evenly as it goes). With one mini-batch: consecutive runs of ``micro`` rows, in order.

    Why tiles: a rank owns a contiguous run of global rows, so when that run is whole tiles (``micro ×
    mini_batches`` divides each rank's rows) each rank forms exactly the micro-batches that one process forms over
    the whole batch. Under bf16 autocast every backward pass rounds its weight gradients to bfloat16, so which rows
    share a pass matters: the same passes on 1 and N processes give the same run up to float32 sums."""
    out: list[list[Tensor]] = [[] for _ in range(mini_batches)]
    tile = micro * mini_batches
    for s in range(0, n_rows, tile):
        rows = torch.arange(s, min(s + tile, n_rows))
        if mini_batches > 1:
            rows = rows[torch.randperm(rows.numel(), generator=generator)]
        for k, part in enumerate(rows.tensor_split(mini_batches)):
            if part.numel():
                out[k].append(part)
    return out


def micro_batches(idx: Tensor, lengths: Tensor, max_seqs: int, max_tokens: int = 0) -> list[Tensor]:
    """Split the row indices ``idx`` [n] of an optimizer step into micro-batches, in order.

    max_tokens = 0: fixed ``max_seqs`` rows each. max_tokens > 0 (dynamic batch size): as many rows as fit
    in ``max_tokens`` real tokens (``lengths`` [n], prompt + response, padding excluded) and at most
    ``max_seqs``; a row longer than the budget goes alone. The loss is normalised by global counts, so
    the split changes memory and speed, never the gradient.
    """
    if max_tokens <= 0:
        return [idx[s : s + max_seqs] for s in range(0, idx.numel(), max_seqs)]
    out, cur, used = [], [], 0
    for i, n in zip(idx.tolist(), lengths.tolist()):
        if cur and (used + n > max_tokens or len(cur) >= max_seqs):
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        out.append(cur)
    return [torch.tensor(c, dtype=torch.long, device=idx.device) for c in out]
