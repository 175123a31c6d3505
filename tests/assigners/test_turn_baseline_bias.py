"""The turn-baseline bias (verl#7244), computed exactly: a null world in which how many turns an episode takes says
nothing about its outcome.

Every group of G = 3 episodes, each taking L ∈ {1, 2, 3} turns independently and uniformly (all 27 groups, equally
likely); every turn that happens earns intermediate reward c; the outcome is the same for all (A^O = 0). The credit an
unbiased method gives the first turn of an episode of L turns, averaged over the groups, is the reward-to-go's:
c·(L − E[L])·(G − 1)/G (the group mean includes the episode itself), so 0 at L = E[L] = 2 and ±2c/3 at L = 1, 3 —
continuing earns c per turn, and nothing else differs.
"""
import itertools

import pytest
import torch

from gearlab import credit
from tests.assigners.turn_batches import make_batch

NAN = float("nan")
C, G = 0.1, 3
SPEC = {1: "0....", 2: "0a1..", 3: "0a1b2"}


def first_turn_credit(name: str, options: dict) -> dict[int, float]:
    """E[credit on a turn-0 token | the episode took L turns], exactly, over all 27 groups."""
    acc: dict[int, list[float]] = {1: [], 2: [], 3: []}
    for lengths in itertools.product((1, 2, 3), repeat=G):
        b = make_batch([SPEC[n] for n in lengths], [[C] * n + [NAN] * (3 - n) for n in lengths], [0.0] * G,
                       obs=[[f"s{k}" for k in range(n)] for n in lengths])  # turn k starts from one shared state
        out = credit.build(name, options).assign(b, torch.zeros(G), {})
        for i, n in enumerate(lengths):
            acc[n].append(float(out.token_advantages[i, 0]))
    return {n: sum(v) / len(v) for n, v in acc.items()}


UNBIASED = {n: C * (n - 2) * (G - 1) / G for n in (1, 2, 3)}


@pytest.mark.parametrize("norm", ["reward_to_go", "zero_fill"])
def test_mt_grpo_reward_to_go_and_zero_fill_credit_extra_turns_with_their_reward(norm):
    got = first_turn_credit("mt_grpo", {"norm": norm, "scale_by_std": False})
    assert got == pytest.approx(UNBIASED, abs=1e-7)


def test_mt_grpo_per_turn_normalisation_taxes_every_extra_turn_away():
    """per_turn subtracts one baseline per turn the episode itself took: the c each extra turn earns never reaches the
    gradient (0 where the unbiased credit is ±2c/3) — an action-dependent baseline."""
    got = first_turn_credit("mt_grpo", {"norm": "per_turn", "scale_by_std": False})
    assert got == pytest.approx({1: 0.0, 2: 0.0, 3: 0.0}, abs=1e-7)
    assert UNBIASED[3] - got[3] == pytest.approx(2 * C / 3)


def test_gigpo_per_episode_baseline_is_unbiased_and_its_cross_step_default_is_not():
    """GiGPO's episode term and its anchor-state step term both carry the reward-to-go (so 2× the unbiased credit).
    With ``cross_steps`` (verl-agent's default) the episode baseline is a mean over STEP items, so an episode of L
    turns weighs L times in it: the baseline leans to long episodes and every episode's credit drifts down, more at
    L = 1 (E[credit] over the null world ≠ 0)."""
    per_episode = first_turn_credit("gigpo", {"gamma": 1.0, "cross_steps": False})
    assert per_episode == pytest.approx({n: 2 * v for n, v in UNBIASED.items()}, abs=1e-7)
    cross = first_turn_credit("gigpo", {"gamma": 1.0})
    drift = sum(cross.values()) / 3
    assert drift < -0.01 and cross[2] < -0.01  # the average episode is pushed down
    assert cross[1] < per_episode[1] and cross[3] < per_episode[3]
