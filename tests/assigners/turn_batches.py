"""Hand-made multi-turn batches for the turn-level assigner tests.

Row specs: a digit d = a token the policy generated in turn d; a/b/c = environment text after
generation 0/1/2 (response_mask 0, attention_mask 1); '.' = padding.
"""
import torch

from gearlab.core.batch import RolloutBatch


def make_batch(specs, turn_rewards, rewards, group_ids=None, obs=None) -> RolloutBatch:
    B, T = len(specs), len(specs[0])
    ids = torch.full((B, T), -1, dtype=torch.long)
    gen = torch.zeros(B, T, dtype=torch.bool)
    real = torch.zeros(B, T, dtype=torch.bool)
    for i, s in enumerate(specs):
        assert len(s) == T
        for t, ch in enumerate(s):
            if ch.isdigit():
                ids[i, t], gen[i, t], real[i, t] = int(ch), True, True
            elif ch in "abc":
                ids[i, t], real[i, t] = "abc".index(ch), True
    return RolloutBatch.from_masks(gen, rewards=rewards, group_ids=group_ids, attention_mask=real, turn_ids=ids,
                                   turn_rewards=torch.tensor(turn_rewards, dtype=torch.float),
                                   meta={} if obs is None else {"anchor_obs": obs})
