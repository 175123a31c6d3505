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
    assert b.to("cpu") is b  # already there: no copy (a GPU target copies every tensor field)


def test_a_cropped_micro_batch_keeps_every_real_tokens_logprob(tiny_model_factory):
    """``cropped``: the prompt columns padded in every row and the response columns padded in every row go; what
    the update computes on the real tokens (the policy's log-probs) is unchanged, and a sub-batch of short responses
    is as wide as its own longest."""
    from gearlab.core.logprobs import response_hidden, token_logprobs

    model = tiny_model_factory(0)
    g = torch.Generator().manual_seed(0)
    B, P, T = 4, 7, 12
    p_len, r_len = torch.tensor([5, 7, 3, 6]), torch.tensor([4, 12, 2, 5])
    prompt_mask = torch.arange(P)[None] >= (P - p_len)[:, None]  # left-padded
    response_mask = torch.arange(T)[None] < r_len[:, None]  # right-padded
    rb = RolloutBatch(prompt_ids=torch.randint(3, 200, (B, P), generator=g) * prompt_mask,
                      prompt_mask=prompt_mask.long(),
                      response_ids=torch.randint(3, 200, (B, T), generator=g) * response_mask,
                      response_mask=response_mask, group_ids=torch.tensor([0, 0, 1, 1]), rewards=torch.zeros(B),
                      old_logprobs=torch.randn(B, T, generator=g) * response_mask)

    def logprobs(b):
        with torch.no_grad():
            h = response_hidden(model, b.input_ids(), b.full_attention_mask(), b.prompt_ids.shape[1], b.response_len)
            return token_logprobs(h, model.get_output_embeddings(), b.response_ids)[0]

    full = logprobs(rb)
    short = rb.select(torch.tensor([0, 2, 3])).cropped()  # prompts of 5, 3, 6 and responses of 4, 2, 5 tokens
    assert short.prompt_ids.shape == (3, 6) and short.response_ids.shape == (3, 5)
    assert torch.equal(short.old_logprobs, rb.old_logprobs[[0, 2, 3], :5])
    kept = logprobs(short)
    assert torch.allclose(kept[short.response_mask], full[[0, 2, 3], :5][short.response_mask], atol=1e-5)
    assert rb.cropped() is rb  # nothing to drop: the same batch
    assert short.cropped() is short
