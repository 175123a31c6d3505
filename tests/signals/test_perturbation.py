"""OAR-P counterfactual-masking saliency (gearlab.signals.perturbation) on the tiny model: against a one-copy-at-a-time
reference, the stride / interpolation, and the KV-shared prefix path against the full recompute."""

import pytest
import torch
import torch.nn.functional as F

import gearlab.signals.perturbation as pert
from gearlab.signals.perturbation import interpolate_skipped, perturb_indices, perturbation_saliency
from gearlab.signals.spans import answer_positions, response_segments
from tests.signals.test_saliency import PROMPTS, SOL, _ctx, _make_batch

# prompts and responses of different lengths (left- / right-padding differ per row); the last row has no reasoning
RAGGED_PROMPTS = PROMPTS + [
    "Compute 1 + 2.", "Compute 9 - 4 + 6 * 2 left to right, carefully, step by step.", "Say 12."
]
RAGGED_SOL = SOL + ["1+2=3\nAnswer: 3", "9-4=5\n5+6=11\n11*2=22\nso the result is 22\nAnswer: 22", "12"]


def _ref_perturbation(model, tok, b, row):
    """One copy at a time, unpadded, full logits (pfinal_mode=last)."""
    seg = response_segments(tok, b.response_ids, b.response_mask)
    a = int(seg.value[row].nonzero()[0])
    prompt = b.prompt_ids[row][b.prompt_mask[row].bool()]
    ids = torch.cat([prompt, b.response_ids[row, :a]])
    rpos = seg.reasoning[row].nonzero().flatten()
    with torch.no_grad():
        lp0 = F.log_softmax(model(ids[None]).logits[0, -1].double(), -1)
        out = []
        for j in rpos.tolist():
            x = ids.clone()
            x[prompt.numel() + j] = tok.pad_token_id
            lp = F.log_softmax(model(x[None]).logits[0, -1].double(), -1)
            out.append((lp0.exp() * (lp0 - lp)).sum())
    return rpos, torch.stack(out)


def test_oar_p_matches_reference_batched_and_one_by_one(tokenizer, tiny_model_factory):
    model = tiny_model_factory(3)
    b = _make_batch(tokenizer, PROMPTS, SOL, extra_pad=3)
    full = perturbation_saliency(_ctx(model, tokenizer, b, mbs=16, perturb_max_positions=0, perturb_kv_share=True))
    single = perturbation_saliency(_ctx(model, tokenizer, b, mbs=1, perturb_max_positions=0, perturb_kv_share=True))
    torch.testing.assert_close(full, single, rtol=2e-3, atol=1e-9)
    reasoning, _ = answer_positions(tokenizer, b.response_ids, b.response_mask)
    assert (full[~reasoning] == 0).all() and (full[reasoning] > 0).all()
    for row in range(2):
        rpos, ref = _ref_perturbation(model, tokenizer, b, row)
        torch.testing.assert_close(full[row, rpos].double(), ref, rtol=2e-3, atol=1e-9)
    # left padding: row 0 alone with an unpadded prompt gives the same values
    one = _make_batch(tokenizer, PROMPTS[:1], SOL[:1])
    s_one = perturbation_saliency(_ctx(model, tokenizer, one, mbs=16, perturb_max_positions=0))
    torch.testing.assert_close(full[0, : one.response_len], s_one[0], rtol=2e-3, atol=1e-9)
    for mode in ("answer_mean", "answer_joint"):
        s = perturbation_saliency(_ctx(model, tokenizer, b, pfinal_mode=mode))
        assert (s[~reasoning] == 0).all() and (s >= 0).all() and (s[reasoning] > 0).any()


def test_oar_p_stride_and_interpolation(tokenizer, tiny_model_factory):
    model = tiny_model_factory(4)
    b = _make_batch(tokenizer, PROMPTS, SOL)
    full = perturbation_saliency(_ctx(model, tokenizer, b, perturb_stride=1, perturb_max_positions=0))
    dflt = perturbation_saliency(_ctx(model, tokenizer, b))  # cap 64 > 15 reasoning tokens → stride 1
    torch.testing.assert_close(dflt, full, rtol=1e-6, atol=0)
    assert perturb_indices(15, 1, 64) == list(range(15))
    assert perturb_indices(15, 4, 0) == [0, 4, 8, 12, 14]
    assert perturb_indices(15, 1, 5) == [0, 3, 6, 9, 12, 14]  # stride = ceil(15/5) = 3, last always kept
    strided = perturbation_saliency(_ctx(model, tokenizer, b, perturb_stride=4, perturb_max_positions=0))
    reasoning, _ = answer_positions(tokenizer, b.response_ids, b.response_mask)
    for row in range(2):
        rpos = reasoning[row].nonzero().flatten()
        idx = perturb_indices(rpos.numel(), 4, 0)
        got = strided[row, rpos]
        torch.testing.assert_close(got[idx], full[row, rpos][idx], rtol=2e-3, atol=1e-9)  # computed exactly
        torch.testing.assert_close(
            got, interpolate_skipped(idx, full[row, rpos][idx], rpos.numel()), rtol=2e-3, atol=1e-9
        )
    # interpolation itself: values 0 at k=0, 4 at k=4 → k=1..3 get 1, 2, 3
    torch.testing.assert_close(interpolate_skipped([0, 4, 5], torch.tensor([0.0, 4.0, 2.0]), 6),
                               torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 2.0]))


# ---------------------------------------------------------------------------------------------- KV-shared prefix
def _count_tokens(model):
    """A counter of the token slots (padding included) fed to the decoder, through a pre-hook on the embedding."""
    n = [0]
    h = model.get_input_embeddings().register_forward_pre_hook(
        lambda mod, args: n.__setitem__(0, n[0] + args[0].numel())
    )
    return n, h


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_kv_shared_equals_full_recompute(tokenizer, tiny_model_factory, attn):
    model = tiny_model_factory(5)
    model.config._attn_implementation = attn
    b = _make_batch(tokenizer, RAGGED_PROMPTS, RAGGED_SOL, extra_pad=2)
    assert len(set(b.prompt_mask.sum(-1).tolist())) > 2 and len(set(b.response_mask.sum(-1).tolist())) > 2
    assert pert._cache_keyword(model) == "cache"
    reasoning, _ = answer_positions(tokenizer, b.response_ids, b.response_mask)
    for mode in ("last", "answer_mean", "answer_joint"):
        # mbs 1: one copy per forward; 3: several copies of one row per forward (masked gaps, right padding), rows in
        # clean chunks of 3; 16: a row's copies all in one forward
        for mbs, cap in ((1, 0), (3, 0), (16, 0), (4, 5)):
            kw = dict(mbs=mbs, pfinal_mode=mode, perturb_max_positions=cap)
            shared = perturbation_saliency(_ctx(model, tokenizer, b, perturb_kv_share=True, **kw))
            full = perturbation_saliency(_ctx(model, tokenizer, b, perturb_kv_share=False, **kw))
            torch.testing.assert_close(shared, full, rtol=1e-4, atol=1e-5)
            assert (shared[~reasoning] == 0).all() and (shared[-1] == 0).all()
            if mode != "answer_joint":
                assert (shared[reasoning] > 0).all()
    # the values themselves are small KLs: compare them at their own scale too
    s = perturbation_saliency(_ctx(model, tokenizer, b, mbs=3, perturb_max_positions=0))
    f = perturbation_saliency(_ctx(model, tokenizer, b, mbs=3, perturb_max_positions=0, perturb_kv_share=False))
    assert ((s - f).abs().max() / f.abs().max()) < 1e-4


def test_kv_shared_forwards_only_the_suffixes(tokenizer, tiny_model_factory):
    model = tiny_model_factory(6)
    b = _make_batch(tokenizer, RAGGED_PROMPTS, RAGGED_SOL, extra_pad=2)
    seg = response_segments(tokenizer, b.response_ids, b.response_mask)
    # per scored row: sequence length L (prompt ⊕ response up to the first answer-value token) and perturbed positions p
    lengths, starts = [], []
    for i in range(b.batch_size):
        rpos = seg.reasoning[i].nonzero().flatten()
        if not rpos.numel():
            continue
        P = int(b.prompt_mask[i].sum())
        lengths.append(P + int(seg.value[i].nonzero()[0]))
        starts.append([P + int(j) for j in rpos])
    n, h = _count_tokens(model)
    try:
        perturbation_saliency(_ctx(model, tokenizer, b, mbs=1, perturb_max_positions=0, perturb_kv_share=False))
        full = n[0]
        n[0] = 0
        perturbation_saliency(_ctx(model, tokenizer, b, mbs=1, perturb_max_positions=0, perturb_kv_share=True))
        shared = n[0]
        n[0] = 0
        perturbation_saliency(_ctx(model, tokenizer, b, mbs=16, perturb_max_positions=0, perturb_kv_share=True))
        shared16 = n[0]
    finally:
        h.remove()
    # one sequence per forward: the full path runs clean + every copy over all L tokens, the shared one each copy
    # over its suffix p..L-1 only
    assert full == sum(L * (1 + len(p)) for L, p in zip(lengths, starts))
    assert shared == sum(L + sum(L - q for q in p) for L, p in zip(lengths, starts))
    assert shared < 0.7 * full
    # batched: clean rows left-padded to the longest, each row's copies (16 per forward, in position order)
    # right-padded to the chunk's longest suffix
    chunks = [(L, p[c : c + 16]) for L, p in zip(lengths, starts) for c in range(0, len(p), 16)]
    assert shared16 == len(lengths) * max(lengths) + sum(len(q) * (L - q[0]) for L, q in chunks)
    assert shared16 < full


def test_kv_share_falls_back_to_the_full_recompute(tokenizer, tiny_model_factory, monkeypatch):
    model = tiny_model_factory(7)
    b = _make_batch(tokenizer, RAGGED_PROMPTS, RAGGED_SOL)
    ref = perturbation_saliency(_ctx(model, tokenizer, b, perturb_kv_share=False))
    n, h = _count_tokens(model)
    try:
        perturbation_saliency(_ctx(model, tokenizer, b, perturb_kv_share=False))
        full = n[0]
        # a clean cache that is not one plain DynamicLayer per layer: the clean chunk is run, then everything is
        # recomputed
        monkeypatch.setattr(pert, "_clean_kv", lambda cache, n, L: None)
        n[0] = 0
        torch.testing.assert_close(
            perturbation_saliency(_ctx(model, tokenizer, b, perturb_kv_share=True)), ref, rtol=0, atol=0
        )
        assert n[0] > full
    finally:
        h.remove()
    monkeypatch.undo()
    # models the shared path does not take
    assert pert._cache_keyword(model) == "cache"
    cfg = model.config
    monkeypatch.setattr(cfg, "layer_types", ["full_attention", "sliding_attention"])
    assert pert._cache_keyword(model) is None
    monkeypatch.undo()
    monkeypatch.setattr(cfg, "_attn_implementation", "flash_attention_2", raising=False)
    assert pert._cache_keyword(model) is None
    monkeypatch.undo()
    monkeypatch.setattr(pert, "DynamicLayer", None)
    assert pert._cache_keyword(model) is None
