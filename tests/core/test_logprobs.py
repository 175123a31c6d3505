"""Chunked log-probs / entropy / KL equal the naive full-logits computation, values and gradients."""
import pytest
import torch

from gearlab.core.logprobs import (
    naive_token_logprobs,
    position_ids_from_mask,
    response_hidden,
    token_kl,
    token_logprobs,
)


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


def _ragged_batch(B=4, P=6, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    plen = torch.tensor([6, 2, 4, 5])[:B]
    rlen = torch.tensor([7, 1, 4, 0])[:B]  # one row with an empty response
    pmask = torch.arange(P)[None] >= (P - plen)[:, None]
    rmask = torch.arange(T)[None] < rlen[:, None]
    ids = torch.cat(
        [torch.randint(5, 300, (B, P), generator=g) * pmask, torch.randint(5, 300, (B, T), generator=g) * rmask], 1
    )
    return ids, torch.cat([pmask, rmask], 1).long(), rmask


def test_packed_equals_padded_values_and_gradients(tiny_model_factory):
    """Packed (padding-free, block-diagonal attention) ≡ padded: the same log-probs, entropies and
    parameter gradients, with ragged prompts and responses (incl. an empty response)."""
    P, T = 6, 7
    ids, mask, rmask = _ragged_batch(P=P, T=T)
    targets = ids[:, P:]
    out = {}
    for packed in (False, True):
        model = tiny_model_factory(0).train()
        h = response_hidden(model, ids, mask, P, T, packed=packed)
        lp, ent = token_logprobs(h, model.get_output_embeddings(), targets, chunk_size=5, with_entropy=True)
        ((lp * rmask).sum() + 0.1 * (ent * rmask).sum()).backward()
        out[packed] = (lp.detach() * rmask, ent.detach() * rmask,
                       {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[True][1], out[False][1], rtol=1e-5, atol=1e-5)
    assert out[True][2].keys() == out[False][2].keys()
    for k, g in out[False][2].items():
        torch.testing.assert_close(out[True][2][k], g, rtol=1e-4, atol=1e-6, msg=k)


def test_packed_rows_do_not_see_each_other(tiny_model_factory):
    """Changing one row's tokens leaves every other row's packed hidden states unchanged."""
    P, T = 6, 7
    ids, mask, _ = _ragged_batch(P=P, T=T)
    model = tiny_model_factory(0)
    with torch.no_grad():
        a = response_hidden(model, ids, mask, P, T, packed=True)
        ids2 = ids.clone()
        ids2[0, P:] = (ids2[0, P:] + 17) % 300 * mask[0, P:]
        b = response_hidden(model, ids2, mask, P, T, packed=True)
    torch.testing.assert_close(a[1:], b[1:], rtol=0, atol=1e-6)
    assert not torch.allclose(a[0], b[0])
