import pytest
import torch

from gearlab.core.batch import RolloutBatch


def _kw(**over):
    kw = dict(prompt_ids=torch.ones(2, 3, dtype=torch.long), prompt_mask=torch.ones(2, 3, dtype=torch.long),
              response_ids=torch.ones(2, 4, dtype=torch.long), response_mask=torch.ones(2, 4, dtype=torch.bool),
              group_ids=torch.tensor([0, 0]), rewards=torch.tensor([1.0, 0.0]))
    kw.update(over)
    return kw


@pytest.mark.parametrize("over,msg", [
    (dict(rewards=torch.tensor([1.0, 0.0, 1.0])), "rewards must be"),
    (dict(old_logprobs=torch.zeros(2, 5)), "old_logprobs must be"),
    (dict(group_ids=torch.tensor([[0, 0]])), "group_ids must be"),
    (dict(rewards=torch.tensor([float("nan"), 0.0])), "non-finite"),
    (dict(attention_mask=torch.zeros(2, 4, dtype=torch.bool)), "response_mask marks tokens"),
    (dict(meta={"texts": ["a"]}), "meta"),
])
def test_invalid_batches_name_the_field(over, msg):
    with pytest.raises(ValueError, match=msg):
        RolloutBatch(**_kw(**over))


def test_select_and_input_layout():
    b = RolloutBatch(**_kw(meta={"texts": ["a", "b"]}))
    s = b.select(torch.tensor([1]))
    assert s.batch_size == 1 and s.meta["texts"] == ["b"]
    assert b.input_ids().shape == (2, 7) and b.full_attention_mask().shape == (2, 7)
