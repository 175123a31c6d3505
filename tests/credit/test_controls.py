"""Placement of segments at uninformed positions (gearlab.credit.controls), the engine of the segmentation controls."""
import torch

from gearlab.credit.controls import place_fixed, place_random


def test_place_random_and_place_fixed():
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        # room for both: always whole, inside the blocks, disjoint, sorted by position, weights attached
        placed = place_random([(0, 9), (12, 29)], [(2, "a"), (4, "b")], gen)
        assert sorted((e - s + 1, w) for s, e, w in placed) == [(2, "a"), (4, "b")]
        assert [s for s, _, _ in placed] == sorted(s for s, _, _ in placed) and placed[0][1] < placed[1][0]
        assert all((0 <= s and e <= 9) or (12 <= s and e <= 29) for s, e, _ in placed)
        # a block of 5 and two segments of 3: the first (longest, then in order) is whole, the second cannot be
        placed = place_random([(0, 4)], [(3, "a"), (3, "b")], gen)
        lengths = {w: e - s + 1 for s, e, w in placed}
        assert lengths["a"] == 3 and 1 <= lengths["b"] <= 2 and placed[0][1] < placed[1][0]
    # the uniform draw: a 4-token segment in a block of 6 has 3 onsets; all of them come up, nothing else
    onsets = {place_random([(10, 15)], [(4, 0)], torch.Generator().manual_seed(s))[0][0] for s in range(60)}
    assert onsets == {10, 11, 12}
    assert place_fixed(list(range(10)), [(0, 9)], 2, ["x", "y", "z"]) == [(0, 1, "x"), (3, 4, "y"), (6, 7, "z")]
    # N = 6 generated positions, k = 2: onsets at index 0 and 3 (position 5); each cut at its block's end
    assert place_fixed([0, 1, 2, 5, 6, 7], [(0, 2), (5, 7)], 5, ["x", "y"]) == [(0, 2, "x"), (5, 7, "y")]
