"""Adding a signal from outside the repository: a module with `@register_signal` (a file given with
`assigner.plugins`, or a package in the `gearlab.signals` entry-point group); an assigner that declares it gets
it computed by the provider, and the contract kit fakes it from its registration."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from gearlab.signals.registry import (FAKES, Signal, available_signals, get_signal, needs_resampler,
                                      signals_on_gathered_weights)

PLUGIN = textwrap.dedent('''
    """A signal and a credit method that uses it, written outside gearlab."""
    import torch
    from gearlab.credit import CreditAssigner, CreditOutput, register
    from gearlab.signals.registry import register_signal

    @register_signal("{sig}", fake="nonneg")
    def position_weight(ctx):
        """1, 2, 3, ... along each response."""
        m = ctx.batch.response_mask.float()
        return m.cumsum(-1)

    @register("{name}")
    class LateTokens(CreditAssigner):
        needs = frozenset({{"{sig}"}})
        preserves_sign = True

        def assign(self, batch, seq_advantages, signals):
            w = signals["{sig}"].detach()
            m = batch.response_mask.float()
            w = w / w.sum(-1, keepdim=True).clamp_min(1e-9) * m.sum(-1, keepdim=True)
            return CreditOutput(token_advantages=seq_advantages[:, None] * w * m)
''')


def test_builtin_signals_are_registered_with_a_fake():
    names = set(available_signals())
    assert {s.value for s in Signal} <= names
    assert all(get_signal(n).fake in FAKES for n in names)
    assert get_signal(Signal.ENTROPY).fn is None and get_signal(Signal.REASONING_MASK).fn is not None
    with pytest.raises(KeyError, match="unknown signal 'nope'; known: "):
        get_signal("nope")


def test_which_builtin_signals_hold_a_sharded_policy_gathered():
    # the provider gathers for these (and FSDP1 on several processes is refused with them); pass signals are the
    # provider's own forward, span masks read tokens only, Monte-Carlo values gather for generation themselves
    builtin = [n for n in available_signals() if get_signal(n).fn is None or
               get_signal(n).fn.__module__.startswith("gearlab.signals.")]
    assert signals_on_gathered_weights(builtin) == [
        "answer_nll_saliency", "input_grad_saliency", "perturbation_saliency", "span_wasserstein", "sum_pi_squared"]
    assert needs_resampler({"mc_step_advantage", Signal.ENTROPY}) and not needs_resampler({"entropy", "nope"})


def test_signal_from_a_file_is_computed_and_faked(tmp_path, tiny_model_factory, tokenizer):
    from gearlab import credit
    from gearlab.credit.contract import check_assigner, random_batch
    from gearlab.signals.provider import SignalProvider

    plugin = tmp_path / "late_tokens.py"
    plugin.write_text(PLUGIN.format(sig="position_weight", name="late_tokens"))
    credit.load_module(str(plugin))
    assert "position_weight" in available_signals() and "late_tokens" in credit.available()
    # the contract kit fakes the plug-in signal from its registration, and the method passes it
    checks = check_assigner("late_tokens")
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]
    # the provider computes it from the registered function (masked positions zeroed)
    batch = random_batch(0)
    model = tiny_model_factory(0)
    _, sig = SignalProvider(model, temperature=1.0, tokenizer=tokenizer).compute(batch, frozenset({"position_weight"}),
                                                                                 with_logprobs=False)
    m = batch.response_mask.float()
    torch.testing.assert_close(sig["position_weight"], m.cumsum(-1) * m)


def test_signal_from_an_entry_point(tmp_path):
    from tests.plugin_site import entry_point_site

    site = entry_point_site(
        tmp_path, "acme_signals", "gearlab.signals", PLUGIN.format(sig="acme_weight", name="acme_late")
    )
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from gearlab.signals.registry import get_signal; "
            "print(get_signal('acme_weight').fake)")
    out = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "nonneg"
