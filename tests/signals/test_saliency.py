"""OAR signals: the reasoning / answer split and the OAR-G saliency on the tiny model (OAR-P: test_perturbation.py)."""

import pytest
import torch
import torch.nn.functional as F

from gearlab.core.batch import RolloutBatch
from gearlab.credit import Signal
from gearlab.signals.saliency import input_grad_saliency, reasoning_noise
from gearlab.signals.registry import SignalContext
from gearlab.signals.provider import SignalProvider
from gearlab.signals.spans import answer_positions, response_segments

SOL = ["7+5=12\n12*3=36\nAnswer: 36", "3*4=12\n12-5=7\nAnswer: 7"]
PROMPTS = ["Compute 7 + 5 * 3 left to right.", "Compute 3 * 4 - 5 left to right."]


def _enc(tok, s):
    return tok(s, add_special_tokens=False)["input_ids"]


def _make_batch(tok, prompts, sols, extra_pad=0):
    """Prompts left-padded (``extra_pad`` more than needed), responses = solution + eos, right-padded."""
    p = [_enc(tok, s) for s in prompts]
    r = [_enc(tok, s) + [tok.eos_token_id] for s in sols]
    P, T = max(map(len, p)) + extra_pad, max(map(len, r))
    pad = tok.pad_token_id
    pid = torch.tensor([[pad] * (P - len(x)) + x for x in p])
    pm = torch.tensor([[0] * (P - len(x)) + [1] * len(x) for x in p])
    rid = torch.tensor([x + [pad] * (T - len(x)) for x in r])
    rm = torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x in r], dtype=torch.bool)
    n = len(sols)
    return RolloutBatch(prompt_ids=pid, prompt_mask=pm, response_ids=rid, response_mask=rm,
                        group_ids=torch.zeros(n, dtype=torch.long), rewards=torch.zeros(n))


def _ctx(model, tok, b, mbs=4, **opts):
    return SignalContext(model, tok, b, 1.0, 256, mbs, dict(opts))


# ---------------------------------------------------------------------------------------------- spans
def test_reasoning_and_answer_positions_on_a_real_response(tokenizer):
    tok = tokenizer
    b = _make_batch(tok, PROMPTS, SOL)
    pieces = [tok.decode([i]) for i in b.response_ids[0].tolist()]
    assert pieces[15:21] == ["Answer", ":", " ", "3", "6", "<|im_end|>"]
    seg = response_segments(tok, b.response_ids, b.response_mask)
    reasoning, answer = answer_positions(tok, b.response_ids, b.response_mask)
    assert reasoning[0].nonzero().flatten().tolist() == list(range(15))  # "7+5=12\n12*3=36\n"
    assert answer[0].nonzero().flatten().tolist() == [15, 16, 17, 18, 19]  # "Answer: 36"; eos in neither
    assert seg.conclude[0].nonzero().flatten().tolist() == [15, 16, 17]
    assert seg.value[0].nonzero().flatten().tolist() == [18, 19]
    n1 = len(_enc(tok, "3*4=12\n12-5=7\n"))
    assert reasoning[1].nonzero().flatten().tolist() == list(range(n1))
    assert not (reasoning & answer).any() and not (reasoning & ~b.response_mask).any()


@pytest.mark.parametrize("text,reasoning_text", [
    ("7+5=12\n12", "7+5=12\n"),  # no marker: the last line is the answer
    ("7+5=12\n12\n\n", "7+5=12\n"),  # trailing blank lines do not count as the last line
    ("12", ""),  # one line, no marker: no reasoning
    ("Answer: 3\nno, 4\nAnswer: 4", "Answer: 3\nno, 4\n"),  # the LAST marker
    ("7+5=12 \u00e9\U0001F642\nAnswer: 12", "7+5=12 \u00e9\U0001F642\n"),  # multi-byte chars: bisection path
])
def test_reasoning_mask_edge_cases(tokenizer, text, reasoning_text):
    tok = tokenizer
    ids = _enc(tok, text) + [tok.eos_token_id, tok.pad_token_id]
    mask = torch.tensor([[True] * (len(ids) - 1) + [False]])
    reasoning, answer = answer_positions(tok, torch.tensor([ids]), mask)
    assert int(reasoning.sum()) == len(_enc(tok, reasoning_text))
    assert reasoning[0, : int(reasoning.sum())].all()
    assert not reasoning[0, -2:].any() and not answer[0, -2:].any()


def test_reasoning_mask_signal_through_the_provider(tokenizer, tiny_model_factory):
    b = _make_batch(tokenizer, PROMPTS, SOL)
    b.response_mask[0, 3] = False  # e.g. an environment token: never reasoning
    sp = SignalProvider(tiny_model_factory(0), temperature=1.0, tokenizer=tokenizer)
    _, sig = sp.compute(b, {Signal.REASONING_MASK}, with_logprobs=False)
    m = sig[Signal.REASONING_MASK]
    assert m.dtype == torch.float32 and m[0].sum() == 14 and m[0, 3] == 0 and m[0, 14] == 1 and m[0, 15] == 0


# ---------------------------------------------------------------------------------------------- OAR-G
def _ref_grad_saliency(model, tok, b, row, sigma, seed, temperature=1.0):
    """Straightforward per-row OAR-G (unpadded, full logits, pfinal_mode=last): the test oracle."""
    seg = response_segments(tok, b.response_ids, b.response_mask)
    a = int(seg.value[row].nonzero()[0])
    prompt = b.prompt_ids[row][b.prompt_mask[row].bool()]
    ids = torch.cat([prompt, b.response_ids[row, :a]])[None]
    P = prompt.numel()
    rpos = seg.reasoning[row].nonzero().flatten()
    e = model.get_input_embeddings()(ids).detach()
    with torch.no_grad():
        lp0 = F.log_softmax(model(inputs_embeds=e).logits[0, -1].double() / temperature, -1)
    noise = torch.zeros_like(e)
    noise[0, P + rpos] = reasoning_noise(seed, row, rpos.numel(), e.shape[-1], sigma).to(e)

    def J(x):
        lp = F.log_softmax(model(inputs_embeds=x + noise).logits[0, -1].double() / temperature, -1)
        return (lp0.exp() * (lp0 - lp)).sum()

    x = e.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(J(x), x)
    signed = (g * e).sum(-1)[0, P + rpos]
    return rpos, signed, J, e, P


def test_oar_g_no_param_grads_flags_restored_zero_outside_deterministic(tokenizer, tiny_model_factory):
    model = tiny_model_factory(0)
    params = list(model.parameters())
    params[0].requires_grad_(False)  # a mixed pattern must come back exactly
    params[3].requires_grad_(False)
    flags = [p.requires_grad for p in params]
    b = _make_batch(tokenizer, PROMPTS, SOL)
    s1 = input_grad_saliency(_ctx(model, tokenizer, b, seed=3))
    assert all(p.grad is None for p in params)
    assert [p.requires_grad for p in params] == flags
    reasoning, _ = answer_positions(tokenizer, b.response_ids, b.response_mask)
    assert (s1[~reasoning] == 0).all() and (s1[reasoning] > 0).all()
    s2 = input_grad_saliency(_ctx(model, tokenizer, b, seed=3))
    assert torch.equal(s1, s2)
    assert not torch.equal(s1, input_grad_saliency(_ctx(model, tokenizer, b, seed=4)))  # the noise matters
    for mode in ("answer_mean", "answer_joint"):
        s = input_grad_saliency(_ctx(model, tokenizer, b, pfinal_mode=mode))
        assert (s[~reasoning] == 0).all() and (s[reasoning] > 0).all() and torch.isfinite(s).all()


def test_oar_g_matches_reference_and_finite_differences(tokenizer, tiny_model_factory):
    model = tiny_model_factory(1).double()  # float64 (Qwen3's RMSNorm still rounds through float32)
    b = _make_batch(tokenizer, PROMPTS, SOL, extra_pad=2)
    seed = 5
    for sigma in (1e-3, 1e-2):
        sal = input_grad_saliency(_ctx(model, tokenizer, b, mbs=2, saliency_noise=sigma, seed=seed))
        for row in range(2):
            rpos, signed, J, e, P = _ref_grad_saliency(model, tokenizer, b, row, sigma, seed)
            torch.testing.assert_close(sal[row, rpos].double(), signed.abs(), rtol=1e-5, atol=1e-14)
    # ⟨∂J/∂e_t, e_t⟩ = d/dα J(e + α·e_t) at α = 0: central differences on every reasoning token of row 0.
    # σ = 1e-2 (J ~ 1e-4) keeps ΔJ far above the float32 rounding inside the model's norms.
    rpos, signed, J, e, P = _ref_grad_saliency(model, tokenizer, b, 0, 1e-2, seed)
    h, fd = 3e-3, []
    with torch.no_grad():
        for t in rpos.tolist():
            d = torch.zeros_like(e)
            d[0, P + t] = e[0, P + t]
            fd.append(((J(e + h * d) - J(e - h * d)) / (2 * h)).item())
    fd = torch.tensor(fd, dtype=torch.float64)
    torch.testing.assert_close(fd, signed, rtol=2e-3, atol=2e-3 * signed.abs().max().item())
    # same ranking: Spearman correlation of |FD| and the signal ≈ 1, same most salient token
    rank = lambda v: v.argsort().argsort().double()  # noqa: E731
    assert torch.corrcoef(torch.stack([rank(fd.abs()), rank(sal[0, rpos].double())]))[0, 1] > 0.99
    assert fd.abs().argmax() == sal[0, rpos].argmax()


def test_oar_g_micro_batching_and_left_padding_do_not_matter(tokenizer, tiny_model_factory):
    model = tiny_model_factory(2)
    big = _make_batch(tokenizer, PROMPTS, SOL, extra_pad=4)
    one = _make_batch(tokenizer, PROMPTS[:1], SOL[:1])  # row 0 alone, unpadded prompt
    s_big = input_grad_saliency(_ctx(model, tokenizer, big, mbs=2))
    s_mb1 = input_grad_saliency(_ctx(model, tokenizer, big, mbs=1))
    s_one = input_grad_saliency(_ctx(model, tokenizer, one, mbs=1))
    torch.testing.assert_close(s_big, s_mb1, rtol=1e-3, atol=1e-10)
    n = one.response_len
    torch.testing.assert_close(s_big[0, :n], s_one[0], rtol=1e-3, atol=1e-10)


# ---------------------------------------------------------------------------------------------- both
def test_signals_through_the_provider_and_assigners(tokenizer, tiny_model_factory):
    from gearlab import credit

    model = tiny_model_factory(0)
    b = _make_batch(tokenizer, PROMPTS, SOL)
    sp = SignalProvider(model, temperature=1.0, micro_batch_size=2, tokenizer=tokenizer)
    for name in ("oar_g", "oar_p"):
        a = credit.build(name)
        _, sig = sp.compute(b, a.needs, with_logprobs=False, options=a.signal_options())
        out = a.assign(b, torch.tensor([1.0, -1.0]), sig)
        torch.testing.assert_close(out.token_advantages.sum(-1), torch.tensor([1.0, -1.0]) * b.response_mask.sum(-1))
        assert all(p.grad is None for p in model.parameters())


def test_oar_g_layer_checkpointing_changes_nothing(tokenizer, tiny_model_factory, monkeypatch):
    """The input-gradient pass recomputes decoder layers in the backward (memory); values are identical
    to the stored-activation pass, and the model's mode and checkpointing flag come back as they were."""
    import contextlib

    import gearlab.signals.saliency as sal

    model = tiny_model_factory(0)
    b = _make_batch(tokenizer, PROMPTS, SOL)
    with sal._layer_checkpointing(model) as on:
        assert on and model.training and model.is_gradient_checkpointing
    assert not model.training and not model.is_gradient_checkpointing
    with_ckpt = input_grad_saliency(_ctx(model, tokenizer, b, seed=1))
    monkeypatch.setattr(sal, "_layer_checkpointing", lambda m: contextlib.nullcontext(False))
    without = input_grad_saliency(_ctx(model, tokenizer, b, seed=1))
    torch.testing.assert_close(with_ckpt, without, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["oar_g", "oar_p"])
def test_rows_left_out_are_zero_cost_no_forward_and_change_no_other_row(tokenizer, tiny_model_factory, kind):
    """SignalContext.rows: a row that is not wanted gets 0 and no forward of its own; every wanted row gets exactly
    the values of the full computation (one row per micro-batch, so no row shares a forward with another)."""
    from gearlab.signals.perturbation import perturbation_saliency

    fn = input_grad_saliency if kind == "oar_g" else perturbation_saliency
    model = tiny_model_factory(0)
    b = _make_batch(tokenizer, PROMPTS, SOL)
    calls = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    full = fn(_ctx(model, tokenizer, b, mbs=1, seed=3))
    n_full = sum(calls)
    assert (full[0] > 0).any() and (full[1] > 0).any()
    for keep in (0, 1):
        calls.clear()
        rows = torch.tensor([keep == 0, keep == 1])
        part = fn(SignalContext(model, tokenizer, b, 1.0, 256, 1, {"seed": 3}, rows=rows))
        assert torch.equal(part[keep], full[keep]) and not part[1 - keep].any()
        assert 0 < sum(calls) < n_full  # the other row cost no embedding lookup, so no forward
    hook.remove()


def test_provider_zeroes_the_rows_left_out_of_model_based_signals_only(tokenizer, tiny_model_factory):
    from gearlab import credit

    model = tiny_model_factory(0)
    b = _make_batch(tokenizer, PROMPTS, SOL)
    sp = SignalProvider(model, temperature=1.0, micro_batch_size=1, tokenizer=tokenizer)
    a = credit.build("oar_g")
    needs = a.needs | {Signal.ENTROPY}
    _, full = sp.compute(b, needs, with_logprobs=False, options=a.signal_options())
    _, part = sp.compute(b, needs, with_logprobs=False, options=a.signal_options(), rows=torch.tensor([True, False]))
    for s in (Signal.INPUT_GRAD_SALIENCY, Signal.REASONING_MASK):
        assert torch.equal(part[s][0], full[s][0]) and not part[s][1].any() and full[s][1].any()
    assert torch.equal(part[Signal.ENTROPY], full[Signal.ENTROPY])  # a pass signal covers every row
