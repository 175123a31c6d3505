"""Placement of a method's segments at uninformed positions: the engine of the segmentation controls
(docs/credit/controls.md). A segment is ``(length, payload)``; the payload (e.g. the segment's weight) is carried
unchanged. Shared by any segmenting assigner whose controls keep its segment count, lengths and weights but move
the segments (``gear``'s ``segmentation=random|fixed``).
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Any

import torch

__all__ = ["place_random", "place_fixed"]


def place_random(runs: list[tuple[int, int]], segments: list[tuple[int, Any]], gen: torch.Generator,
                 tries: int = 32) -> list[tuple[int, int, Any]]:
    """Put each (length, weight) segment at a random onset: ``runs`` are the row's blocks of generated tokens
    (first, last position, inclusive) that a segment may not leave (masked tokens, turn changes). Longest first
    (ties in the given order); the onset is uniform over the positions where the segment fits whole without
    touching an already placed one, or, when there is none, over every free position, the segment then cut at
    the end of its free gap. Returns (first, last, weight) sorted by position.

    Uniform by rejection: up to ``tries`` onsets drawn among all generated positions, the first that fits is
    taken (conditionally uniform over those that fit); after that the free gaps are listed and one draw decides.
    O(T + k·L) per row instead of O(k²) for k segments."""
    runs = [(s, e) for s, e in runs if e >= s]
    if not runs:
        return []
    cand = [p for s, e in runs for p in range(s, e + 1)]
    block_end = [0] * (runs[-1][1] + 1)
    for s, e in runs:
        block_end[s:e + 1] = [e] * (e - s + 1)
    taken = bytearray(len(block_end))

    def fits(p: int, length: int) -> bool:
        return p + length - 1 <= block_end[p] and not any(taken[p:p + length])

    out = []
    for j in sorted(range(len(segments)), key=lambda j: -segments[j][0]):
        length, weight = segments[j]
        first = -1
        for _ in range(tries):
            p = cand[int(torch.randint(len(cand), (1,), generator=gen))]
            if fits(p, length):
                first, last = p, p + length - 1
                break
        if first < 0:  # list the free gaps: a whole fit if any is left, else any free token, cut at its gap's end
            gaps, s = [], None
            for p in cand:
                if taken[p]:
                    continue
                if s is None or p != gaps[-1][1] + 1 or block_end[p] != block_end[s]:
                    gaps.append((p, p))
                    s = p
                else:
                    gaps[-1] = (s, p)
            room = [max(0, e - g + 2 - length) for g, e in gaps]  # onsets g .. e − length + 1
            if sum(room) == 0:
                room = [e - g + 1 for g, e in gaps]
            if sum(room) == 0:  # cannot happen when the segments came from these runs; never loop on it
                break
            u = int(torch.randint(sum(room), (1,), generator=gen))
            r = 0
            while u >= room[r]:
                u -= room[r]
                r += 1
            first = gaps[r][0] + u
            last = min(first + length - 1, gaps[r][1])
        taken[first:last + 1] = b"\x01" * (last - first + 1)
        out.append((first, last, weight))
    return sorted(out, key=lambda x: x[0])


def place_fixed(
    positions: list[int], runs: list[tuple[int, int]], length: int, weights: list[Any]
) -> list[tuple[int, int, Any]]:
    """k = len(weights) segments of ``length`` at regular onsets: onset j is the generated token of index
    floor(j·N/k) (``positions`` = the N generated positions); each ends at its block's end (``runs``) or before
    the next onset if sooner. Returns (first, last, weight) in order."""
    k, n = len(weights), len(positions)
    onsets = [positions[(j * n) // k] for j in range(k)]
    run_first = [s for s, _ in runs]
    out = []
    for j, first in enumerate(onsets):
        block_end = runs[bisect_right(run_first, first) - 1][1]
        last = min(first + length - 1, block_end, onsets[j + 1] - 1 if j + 1 < k else block_end)
        out.append((first, last, weights[j]))
    return out
