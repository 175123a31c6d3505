"""Chunked log-probs / entropy / KL equal the naive full-logits computation, values and gradients."""
import pytest
import torch

from gearlab.logprobs import naive_token_logprobs, position_ids_from_mask, response_hidden, token_kl, token_logprobs


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_entropy_match_naive(chunk, temperature):
    torch.manual_seed(0)
    B, T, H, V = 3, 11, 16, 50
    head = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(B, T, H, requires_grad=True)
    y = torch.randint(0, V, (B, T))
    lp, ent = token_logprobs(hidden, head, y, temperature=temperature, chunk_size=chunk, with_entropy=True)
    lp_ref, ent_ref = naive_token_logprobs(head(hidden), y, temperature)
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=1e-6)
    w = torch.randn(B, T)
    g = torch.autograd.grad((lp * w).sum() + ent.sum(), [hidden, head.weight])
    g_ref = torch.autograd.grad((lp_ref * w).sum() + ent_ref.sum(), [hidden, head.weight])
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_token_kl_matches_naive():
    torch.manual_seed(1)
    B, T, H, V = 2, 9, 8, 30
    head = torch.nn.Linear(H, V)
    hs, ht = torch.randn(B, T, H), torch.randn(B, T, H)
    kl = token_kl(hs, ht, head, temperature=0.9, chunk_size=4)
    ls = torch.log_softmax(head(hs) / 0.9, -1)
    lt = torch.log_softmax(head(ht) / 0.9, -1)
    ref = torch.nn.functional.kl_div(lt, ls, log_target=True, reduction="none").sum(-1)  # KL(s || t)
    torch.testing.assert_close(kl, ref, rtol=1e-5, atol=1e-6)
    assert (kl >= -1e-6).all()


def test_response_positions_match_full_forward_with_left_padding(tiny_model_factory):
    """The hidden state at P-1+t predicts response token t, with the same position ids HF generate uses:
    a left-padded row gives the same log-probs as the same row alone without padding."""
    model = tiny_model_factory(0)
    V = model.config.vocab_size
    torch.manual_seed(2)
    prompt = torch.randint(5, V, (2, 6))
    prompt_mask = torch.ones_like(prompt)
    prompt[0, :3] = 0
    prompt_mask[0, :3] = 0  # row 0 is left-padded
    resp = torch.randint(5, V, (2, 5))
    ids = torch.cat([prompt, resp], 1)
    mask = torch.cat([prompt_mask, torch.ones_like(resp)], 1)
    with torch.no_grad():
        h = response_hidden(model, ids, mask, 6, 5)
        lp, _ = token_logprobs(h, model.get_output_embeddings(), resp, chunk_size=3)
        # reference: the unpadded row 0 alone through the full model's logits
        solo = torch.cat([prompt[0, 3:], resp[0]])[None]
        logits = model(solo).logits[0, 2:-1]  # positions predicting the 5 response tokens
        ref = torch.log_softmax(logits.float(), -1).gather(-1, resp[0][:, None]).squeeze(-1)
    torch.testing.assert_close(lp[0], ref, rtol=1e-4, atol=1e-5)
    assert position_ids_from_mask(mask)[0].tolist()[:4] == [0, 0, 0, 0]
