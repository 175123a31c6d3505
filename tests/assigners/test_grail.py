"""GRAIL (assigners/grail.py, docs/credit/grail.md) against a transcription of the authors' code
(declare-lab/grail@749aa4c, ``GrailTrainerV2.compute_grail_weights``: the attribution pass and the weights), the
``answer_nll_saliency`` signal for every leaf, the contract kit; and the authors' own OAR-G weight map
(``compute_oar_g_weights``) against gearlab's ``oar_g`` reshaping: a second source for OAR."""
import pytest
import torch
import torch.nn.functional as F

from gearlab.core.batch import RolloutBatch
from gearlab.credit.contract import assert_contract
from gearlab.signals.answer_saliency import answer_nll_saliency
from gearlab.signals.registry import SignalContext
from gearlab.signals.spans import response_segments

from assigners.grail import answer_regions, grail_weights
from assigners.oar import bilevel_weights

SOL = ["7+5=12\n12*3=36\nAnswer: 36", "3*4=12\n12-5=7\nAnswer: 7", "9-4=5\n5*5=25\nAnswer: 25"]
PROMPTS = ["Compute 7 + 5 * 3 left to right.", "Compute 3 * 4 - 5 left to right.", "Compute 9 - 4 * 5 left to right."]


# ---------------------------------------------------------------------------------- the source, transcribed
def ref_weights(s, mask, adv, answer, boundary, content, post, std, mean, w_min, w_max, symmetry):
    """compute_grail_weights, its second phase: log-saliency z-scored per row, mapped, clipped, overridden."""
    fallback = ~answer.any(-1, keepdim=True)
    a = adv[:, None]
    if symmetry == "correct":
        fallback = fallback | (a <= 0)
    elif symmetry == "wrong":
        fallback = fallback | (a > 0)
    m = mask.float()
    ls = torch.log(s + 1e-8)
    n = m.sum(-1, keepdim=True).clamp(min=1)
    mu = (ls * m).sum(-1, keepdim=True) / n
    sd = torch.sqrt((((ls - mu) ** 2) * m).sum(-1, keepdim=True) / n + 1e-8)
    w = torch.clamp(mean + std * (ls - mu) / sd, min=w_min, max=w_max)
    w = torch.where(fallback, torch.ones_like(w), w) * m
    w[content] = w_max
    w[boundary] = mean
    w[post & mask.bool()] = mean
    return w


def ref_attribution(model, ids, attn, completion, answer, leaf, temperature=1.0):
    """compute_grail_weights, its first phase: −Σ log p(answer-span tokens) differentiated with respect to a detached
    embedding leaf or one hidden-state layer; gradient and activation sliced [-(T+1):-1]; ‖g ⊙ a‖₂."""
    T = completion.shape[1]
    with torch.enable_grad():
        emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        out = model.model(inputs_embeds=emb, attention_mask=attn, use_cache=False, output_hidden_states=True)
        hs = out.hidden_states
        L = len(hs) - 1
        a = emb if leaf == "embeddings" else hs[{"first": 1, "middle": L // 2, "last": L - 1}[leaf]]
        h = out.last_hidden_state[:, :-1][:, -T:]
        logits = F.linear(h, model.lm_head.weight.detach()) / temperature
        lp = logits.log_softmax(-1).gather(-1, completion[..., None]).squeeze(-1)
        g = torch.autograd.grad(-lp[answer].sum(), a)[0]
    return (g[:, -(T + 1):-1].float() * a[:, -(T + 1):-1].detach().float()).norm(dim=-1)


def ref_oar_g_map(s, mask, tau=0.4, beta=2.0, eps=1e-12):
    """compute_oar_g_weights, its scoring: log1p, min-max, the floor(n·τ)-th order statistic, suppress / boost,
    then every row rescaled to mean 1 over its tokens."""
    m = mask.float()
    x = torch.log(1 + s) * m
    hi = (x - (1 - m) * 1e9).max(-1, keepdim=True)[0]
    lo = (x + (1 - m) * 1e9).min(-1, keepdim=True)[0]
    xh = (x - lo) / (hi - lo + eps)
    n = m.sum(-1, keepdim=True)
    srt = xh.masked_fill(~mask, float("inf")).sort(-1)[0]
    k = (n * tau).long().clamp(min=0)
    k = torch.minimum(k, (n.long() - 1).clamp(min=0))
    t = srt.gather(-1, k)
    om = torch.where(xh < t, torch.clamp(xh / (t + eps), min=0.1), 1 + beta * (xh - t) / (1 - t + eps)) * m
    return om * n / (om.sum(-1, keepdim=True) + 1e-8)


# ---------------------------------------------------------------------------------------------- helpers
def _batch(tok, sols=SOL, prompts=PROMPTS):
    """Prompts of one length (no left padding: the source passes no position ids), responses right-padded."""
    p = [tok(s, add_special_tokens=False)["input_ids"] for s in prompts]
    assert len({len(x) for x in p}) == 1
    r = [tok(s, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for s in sols]
    T = max(map(len, r))
    rid = torch.tensor([x + [tok.pad_token_id] * (T - len(x)) for x in r])
    rm = torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x in r], dtype=torch.bool)
    n = len(sols)
    return RolloutBatch(prompt_ids=torch.tensor(p), prompt_mask=torch.ones(n, len(p[0]), dtype=torch.long),
                        response_ids=rid, response_mask=rm, group_ids=torch.zeros(n, dtype=torch.long),
                        rewards=torch.tensor([1.0, 0.0, 0.0]))


def _random_regions(seed, B=6, T=14):
    """(mask, span, value, generator): each row some reasoning, a one-token marker, a value, then the stop token."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    span = torch.zeros(B, T, dtype=torch.bool)
    value = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate(lengths.tolist()):
        r = int(torch.randint(1, n - 3, (1,), generator=g))
        span[i, r : n - 1] = True
        value[i, r + 1 : n - 1] = True
    span[-1] = value[-1] = False  # a row without an answer
    return mask, span, value, g


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("symmetry", ["both", "correct", "wrong"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weights_equal_the_sources(seed, symmetry):
    mask, span, value, g = _random_regions(seed)
    B, T = mask.shape
    sal = torch.rand(B, T, generator=g).pow(3) * 5 * mask
    adv = torch.randn(B, generator=g)
    adv[0] = 0.0  # a zero advantage counts as "wrong" in the source
    has, marker, val, tail = answer_regions(span, value, mask)
    kw = dict(std=0.5, mean=1.0, w_min=0.5, w_max=5.0, symmetry=symmetry)
    ours = grail_weights(sal, mask, adv, has, marker, val, tail, **kw)
    ref = ref_weights(sal, mask, adv, marker | val, marker, val, tail, **kw)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
    assert (ours[-1][mask[-1]] == 1.0).all()  # no answer: uniform credit


def test_symmetry_wrong_reweights_only_non_positive_advantages():
    mask, span, value, g = _random_regions(5)
    reasoning = mask & ~span & (torch.arange(mask.shape[1])[None] < span.float().argmax(-1, keepdim=True))
    sal = torch.rand(*mask.shape, generator=g) * mask
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 1.0])
    has, marker, val, tail = answer_regions(span, value, mask)
    w = grail_weights(sal, mask, adv, has, marker, val, tail, symmetry="wrong")
    for i in (0, 2):  # correct rollouts: 1 on the reasoning, 5 on the value, 1 on the marker and the tail
        assert (w[i][reasoning[i]] == 1.0).all() and (w[i][val[i]] == 5.0).all()
    assert not (w[1][reasoning[1]] == 1.0).all()  # a wrong rollout's reasoning is reweighted
    plain = grail_weights(sal, mask, adv, has, marker, val, tail, symmetry="wrong", answer_overrides=False)
    assert not (plain[1][val[1]] == 5.0).all() and (plain[0][mask[0]] == 1.0).all()  # saliency on the value too


@pytest.mark.parametrize("leaf", ["embeddings", "first", "middle", "last"])
def test_saliency_signal_equals_the_sources_attribution(tokenizer, tiny_model_factory, leaf):
    model = tiny_model_factory(0).eval()
    b = _batch(tokenizer)
    ctx = SignalContext(model, tokenizer, b, 1.0, 256, 2, {"leaf": leaf})
    ours = answer_nll_saliency(ctx)
    answer = response_segments(tokenizer, b.response_ids, b.response_mask).answer
    ref = ref_attribution(model, b.input_ids(), b.full_attention_mask(), b.response_ids, answer, leaf)
    ref = ref * b.response_mask
    assert ours.shape == ref.shape and (ours[b.response_mask] > 0).float().mean() > 0.5
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-7)
    last = [int(answer[i].nonzero().max()) for i in range(3)]
    assert all((ours[i, last[i] + 1:] == 0).all() for i in range(3))  # nothing after the answer: the stop token
    assert all(p.grad is None for p in model.parameters())


def test_saliency_does_not_depend_on_the_micro_batch_or_left_padding(tokenizer, tiny_model_factory):
    model = tiny_model_factory(1).eval()
    b = _batch(tokenizer)
    one = answer_nll_saliency(SignalContext(model, tokenizer, b, 1.0, 256, 1, {}))
    three = answer_nll_saliency(SignalContext(model, tokenizer, b, 1.0, 256, 3, {}))
    torch.testing.assert_close(one, three, rtol=1e-4, atol=1e-7)
    pad = tokenizer.pad_token_id
    padded = RolloutBatch(prompt_ids=torch.cat([torch.full((3, 2), pad), b.prompt_ids], 1),
                          prompt_mask=torch.cat([torch.zeros(3, 2, dtype=torch.long), b.prompt_mask], 1),
                          response_ids=b.response_ids, response_mask=b.response_mask, group_ids=b.group_ids,
                          rewards=b.rewards)
    torch.testing.assert_close(answer_nll_saliency(SignalContext(model, tokenizer, padded, 1.0, 256, 3, {})), one,
                               rtol=1e-4, atol=1e-7)


def test_grail_passes_the_contract_kit():
    assert_contract("grail")
    assert_contract("grail", {"symmetry": "both", "w_min": 0.1})
    assert_contract("grail", {"symmetry": "correct", "leaf": "middle"})


def test_the_authors_oar_g_map_is_gearlabs_bilevel_reshaping_where_their_quantiles_agree():
    """A second source for OAR (declare-lab/grail's OAR-G baseline, tau 0.4, beta 2): with six tokens the
    floor(n·τ)-th order statistic and the interpolated τ-quantile are both the third value, and the two maps agree;
    with five they pick different thresholds (docs/credit/grail.md#oar-g-in-the-grail-repository)."""
    g = torch.Generator().manual_seed(0)
    for n, agree in ((6, True), (5, False)):
        s = torch.rand(8, n, generator=g) * 3
        mask = torch.ones(8, n, dtype=torch.bool)
        ours = bilevel_weights(s, mask, q=0.4, beta=2.0, floor=0.1, sum_to_L=True)
        ref = ref_oar_g_map(s, mask)
        assert torch.allclose(ours, ref, atol=1e-5) is agree
