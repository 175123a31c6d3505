"""SignalProvider computes exactly the declared signals; the teacher sees privileged prompt ⊕ the same tokens."""
import torch

from gearlab.core.batch import RolloutBatch
from gearlab.credit import Signal
from gearlab.core.logprobs import naive_token_logprobs
from gearlab.signals.provider import SignalProvider


def _batch(V):
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, V, (3, 5), generator=g)
    pmask = torch.ones_like(prompt)
    prompt[1, :2], pmask[1, :2] = 0, 0
    tprompt = torch.randint(5, V, (3, 8), generator=g)
    tmask = torch.ones_like(tprompt)
    tprompt[2, :4], tmask[2, :4] = 0, 0
    resp = torch.randint(5, V, (3, 6), generator=g)
    rmask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4], dtype=torch.bool)
    return RolloutBatch(prompt_ids=prompt, prompt_mask=pmask, response_ids=resp, response_mask=rmask,
                        group_ids=torch.tensor([0, 0, 0]), rewards=torch.tensor([1.0, 0.0, 1.0]),
                        teacher_prompt_ids=tprompt, teacher_prompt_mask=tmask)


def _count_forwards(model):
    calls = {"n": 0}
    base = getattr(model, model.base_model_prefix)
    base.register_forward_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    return calls


def _solo_logprobs(model, prompt, pmask, resp, T=1.0):
    ids = torch.cat([prompt[pmask.bool()], resp])[None]
    with torch.no_grad():
        logits = model(ids).logits[0, pmask.sum() - 1 : -1]
    return naive_token_logprobs(logits, resp, T)


def test_no_signals_means_one_student_pass_and_no_teacher(tiny_model_factory):
    model = tiny_model_factory(0)
    calls = _count_forwards(model)
    sp = SignalProvider(model, temperature=1.0, micro_batch_size=8)
    ppass, sig = sp.compute(_batch(model.config.vocab_size), frozenset())
    assert sig == {} and calls["n"] == 1 and ppass.entropy is None
    ppass, sig = sp.compute(_batch(model.config.vocab_size), frozenset(), with_logprobs=False)
    assert ppass is None and calls["n"] == 1  # nothing asked, nothing computed


def test_teacher_and_entropy_values(tiny_model_factory):
    model = tiny_model_factory(1)
    b = _batch(model.config.vocab_size)
    calls = _count_forwards(model)
    sp = SignalProvider(model, temperature=0.8, chunk_size=5, micro_batch_size=2)
    ppass, sig = sp.compute(b, {Signal.ENTROPY, Signal.TEACHER_LOGPROBS, Signal.TEACHER_KL})
    assert set(sig) == {Signal.ENTROPY, Signal.TEACHER_LOGPROBS, Signal.TEACHER_KL}
    assert calls["n"] == 4  # 2 micro-batches × (student + teacher)
    for i in range(3):
        n = int(b.response_mask[i].sum())
        lp, ent = _solo_logprobs(model, b.prompt_ids[i], b.prompt_mask[i], b.response_ids[i], 0.8)
        tlp, _ = _solo_logprobs(model, b.teacher_prompt_ids[i], b.teacher_prompt_mask[i], b.response_ids[i], 0.8)
        torch.testing.assert_close(ppass.logprobs[i, :n], lp[:n], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(sig[Signal.ENTROPY][i, :n], ent[:n], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(sig[Signal.TEACHER_LOGPROBS][i, :n], tlp[:n], rtol=1e-4, atol=1e-5)
        assert (sig[Signal.TEACHER_KL][i, n:] == 0).all() and (sig[Signal.ENTROPY][i, n:] == 0).all()
    assert (sig[Signal.TEACHER_KL][b.response_mask] > 0).all()


def test_each_micro_batch_runs_at_its_own_widths(tiny_model_factory):
    """With ``crop``, a micro-batch drops the columns padded in all its rows (prompt, teacher prompt, response)
    before its forwards, its signals are padded back to the batch's T, and they are the solo values."""
    model = tiny_model_factory(1)
    b = _batch(model.config.vocab_size)
    widths = []
    base = getattr(model, model.base_model_prefix)
    base.register_forward_pre_hook(lambda m, args, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    sp = SignalProvider(model, temperature=1.0, micro_batch_size=2, crop=True)  # (default: on with CUDA)
    ppass, sig = sp.compute(b, {Signal.TEACHER_LOGPROBS})
    # rows 0-1: prompt 5 + response 6, teacher 8 + 6; row 2: prompt 5 + response 2, teacher 4 + 2
    assert widths == [11, 14, 7, 6]
    assert ppass.logprobs.shape == sig[Signal.TEACHER_LOGPROBS].shape == (3, 6)
    for i in range(3):
        n = int(b.response_mask[i].sum())
        tlp, _ = _solo_logprobs(model, b.teacher_prompt_ids[i], b.teacher_prompt_mask[i], b.response_ids[i])
        torch.testing.assert_close(sig[Signal.TEACHER_LOGPROBS][i, :n], tlp[:n], rtol=1e-4, atol=1e-5)


def test_signal_passes_leave_cudnn_attention_out_and_restore_it(tiny_model_factory):
    """Every forward of ``compute`` runs with cuDNN's SDPA backend disabled (its forward does not repeat bit for bit
    on Hopper, so a GEAR run did not repeat), and the caller's setting is back afterwards."""
    model = tiny_model_factory(2)
    seen = []
    base = getattr(model, model.base_model_prefix)
    base.register_forward_hook(lambda *a: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    assert torch.backends.cuda.cudnn_sdp_enabled()
    SignalProvider(model, temperature=1.0, micro_batch_size=2).compute(
        _batch(model.config.vocab_size), {Signal.ENTROPY, Signal.TEACHER_KL})
    assert seen == [False] * 4  # 2 micro-batches × (student + teacher), none with cuDNN
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_resampling_signals_run_outside_the_gathered_block(tiny_model_factory, monkeypatch):
    """A signal that runs the policy runs with the weights held gathered; one that continues responses runs after,
    outside it (its continuations gather for generation): both in one call, each where it belongs."""
    import contextlib

    import gearlab.signals.provider as provider
    import gearlab.signals.registry as registry

    registry.load_builtin_and_installed()
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # the two test signals leave with the test

    where: dict[str, bool] = {}
    state = {"inside": False}

    @contextlib.contextmanager
    def fake_gathered(model):
        state["inside"] = True
        try:
            yield
        finally:
            state["inside"] = False

    @registry.register_signal("_test_forward_signal")
    def forward_signal(ctx):
        where["forward"] = state["inside"]
        return ctx.batch.response_mask.float()

    @registry.register_signal("_test_resampling_signal", resamples=True)
    def resampling_signal(ctx):
        where["resampling"] = state["inside"]
        return 2 * ctx.batch.response_mask.float()

    monkeypatch.setattr(provider, "gathered_for_signals", fake_gathered)
    model = tiny_model_factory(0)
    b = _batch(model.config.vocab_size)
    _, sig = SignalProvider(model, temperature=1.0).compute(
        b, frozenset({"_test_forward_signal", "_test_resampling_signal"}), with_logprobs=False, resampler=object())
    assert where == {"forward": True, "resampling": False}
    torch.testing.assert_close(sig["_test_resampling_signal"], 2 * b.response_mask.float())


def test_signal_functions_run_without_autograd_unless_they_turn_it_on(tokenizer, tiny_model_factory):
    """A forward kept for its outputs keeps no activations: SHEAR's hidden-state forwards ran with autograd on
    (~8 GiB per 4K-token row of a 0.6B model, measured on an H100); GRAIL's backpropagating signal, run the same
    way, still gives its saliency."""
    from gearlab.signals.answer_saliency import ANSWER_NLL_SALIENCY, answer_nll_saliency
    from gearlab.signals.registry import SignalContext
    from gearlab.signals.span_wasserstein import SPAN_WASSERSTEIN

    model = tiny_model_factory(0)
    b = _batch(model.config.vocab_size)
    modes = []
    getattr(model, model.base_model_prefix).register_forward_hook(lambda *a: modes.append(torch.is_grad_enabled()))
    provider = SignalProvider(model, temperature=1.0, micro_batch_size=2, tokenizer=tokenizer)
    _, sig = provider.compute(b, frozenset({SPAN_WASSERSTEIN}), with_logprobs=False)
    assert modes == [False, False] and sig[SPAN_WASSERSTEIN].grad_fn is None  # 2 micro-batches
    modes.clear()
    ans = "The answer is 7.\nAnswer: 7"
    rid = torch.tensor([tokenizer(ans, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]] * 3)
    b = RolloutBatch(prompt_ids=b.prompt_ids, prompt_mask=b.prompt_mask, response_ids=rid,
                     response_mask=torch.ones_like(rid, dtype=torch.bool), group_ids=b.group_ids, rewards=b.rewards)
    _, sig = provider.compute(b, frozenset({ANSWER_NLL_SALIENCY}), with_logprobs=False)
    assert modes and all(modes)  # GRAIL turned autograd on for its own passes
    direct = answer_nll_saliency(SignalContext(model, tokenizer, b, 1.0, 256, 2, {}))
    assert (direct[b.response_mask] > 0).any()
    torch.testing.assert_close(sig[ANSWER_NLL_SALIENCY], direct, rtol=0, atol=0)
