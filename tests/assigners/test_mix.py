"""The `mix` assigner (docs/credit/mix.md): a weighted sum of other methods' token advantages, one signal \
computation."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gearlab import credit
from gearlab.credit import Signal
from gearlab.credit.contract import _seq_adv, assert_contract, check_assigner, fake_signals, random_batch
from gearlab.credit.methods import build_method, method_spec
from gearlab.credit.options import OptionError

from assigners.mix import MixAssigner

CONF = Path(__file__).parents[2] / "conf" / "assigner"
TASK = {
    False: type("Single", (), {"multi_turn": False, "name": "s"})(),
    True: type("Multi", (), {"multi_turn": True, "name": "m"})()
}


def _run(*assigners, seed: int = 0):
    """Outputs of each assigner on one batch and one set of signals (the union of their needs)."""
    multi = any(a.requires_turns for a in assigners)
    b = random_batch(seed, multi_turn=multi)
    adv = _seq_adv(b)
    sig = fake_signals(b, frozenset().union(*(a.needs for a in assigners)), seed)
    outs = []
    for a in assigners:
        a.setup(seed=0, total_steps=10, task=TASK[multi])
        outs.append(a.assign(b, adv, sig))
    return b, outs


def _effective(out, b) -> torch.Tensor:
    m = b.response_mask if out.loss_mask is None else out.loss_mask.bool()
    return out.token_advantages * m.float()


@pytest.mark.parametrize("name", [n for n in credit.available() if n != "mix"] + ["gear_random", "gear:q_on=0.8"])
@pytest.mark.parametrize("seed", [0, 1])
def test_one_component_of_weight_one_is_that_component(name, seed):
    comp = build_method(name)
    mix = credit.build("mix", {"components": [name]})
    assert mix.needs == comp.needs and mix.preserves_sign == comp.preserves_sign
    assert (mix.preserves_mass, mix.requires_turns, mix.keeps_zero_groups) == (
        comp.preserves_mass, comp.requires_turns, comp.keeps_zero_groups)
    b, (want, got) = _run(comp, mix, seed=seed)
    if want.loss_mask is None:
        assert got.loss_mask is None and torch.equal(got.token_advantages, want.token_advantages)
    else:  # the component counts nothing outside its own loss mask: only the effective credit is kept
        assert torch.equal(got.loss_mask, want.loss_mask.bool())
        assert torch.equal(got.token_advantages, _effective(want, b))
    assert got.metrics[f"mix/{name}_abs_share"] in (0.0, 1.0)
    assert all(got.metrics[f"{name}/{k}"] == float(v) for k, v in want.metrics.items())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_plus_opsd_is_the_weighted_sum(seed):
    mix = credit.build("mix", {"components": [{"method": "grpo", "weight": 0.3}, {"method": "opsd", "weight": 0.7}]})
    g, o = credit.build("grpo"), credit.build("opsd")
    assert mix.needs == g.needs | o.needs == {Signal.LOGPROBS, Signal.TEACHER_LOGPROBS}
    b, (outg, outo, out) = _run(g, o, mix, seed=seed)
    torch.testing.assert_close(out.token_advantages, 0.3 * outg.token_advantages + 0.7 * outo.token_advantages)
    assert out.loss_mask is None and out.token_advantages.dtype == torch.float32
    # the shares of |credit| add up to 1 and match a recount
    sg = (0.3 * outg.token_advantages).abs()[b.response_mask].sum()
    so = (0.7 * outo.token_advantages).abs()[b.response_mask].sum()
    assert out.metrics["mix/grpo_abs_share"] == pytest.approx(float(sg / (sg + so)), rel=1e-5)
    assert out.metrics["mix/grpo_abs_share"] + out.metrics["mix/opsd_abs_share"] == pytest.approx(1.0)
    assert {f"opsd/{k}" for k in outo.metrics} <= set(out.metrics)


@pytest.mark.parametrize("label", ["mix", "grpo_opsd", "gear_rlsd"])
def test_the_contract_kit_passes(label):
    spec = method_spec(label)
    assert_contract(spec.base, spec.options)


def test_promise_rules():
    a = credit.build("mix", {"components": [{"method": "oar_g", "weight": 0.25}, {"method": "gear", "weight": 0.75}]})
    assert a.preserves_mass and a.preserves_sign and a.keeps_zero_groups
    names = {c.name for c in check_assigner("mix", {"components": a.components}) if c.ok}
    assert {"mass preserved (Σ_t A_t = N·A)", "sign preserved", "zero-advantage sequences stay zero"} <= names
    neg = credit.build("mix", {"components": [{"method": "oar_g", "weight": 1.5}, {"method": "gear", "weight": -0.5}]})
    assert neg.preserves_mass and not neg.preserves_sign  # sums to 1, but gear's credit is reversed
    assert not credit.build("mix", {"components": [{"method": "oar_g", "weight": 0.5}, "gear"]}).preserves_mass
    assert not build_method("gear_rlsd").preserves_mass  # weights sum to 1, but rlsd keeps no mass
    assert credit.build(
        "mix", {"components": [{"method": "grpo", "weight": 0.5}, {"method": "gear", "weight": 0.5}]}
    ).preserves_mass
    t = credit.build("mix", {"components": ["mt_grpo", "grpo"]})
    assert t.requires_turns and not t.keeps_zero_groups
    with pytest.raises(ValueError, match="single-turn"):
        t.setup(seed=0, total_steps=1, task=TASK[False])


@pytest.mark.parametrize("components, text", [
    ([], "at least one component"),
    ("grpo", "expected list"),
    ([{"method": "grpo", "weight": "half"}], "entry 0 (grpo): weight must be a finite number"),
    ([{"method": "grpo", "weight": float("inf")}], "finite"),
    ([{"method": "grpo", "weight": True}], "finite"),
    (["grpo", {"method": "nope"}], "entry 1: unknown method 'nope'"),
    (["grpo", 3], "entry 1: expected a method label or a mapping"),
    ([{"method": "grpo", "wieght": 1}], "unknown keys ['wieght']"),
    ([{"weight": 1}], "'method' must be a method label"),
    ([{"method": "opsd", "options": 3}], "options must be a mapping"),
    (["mix"], "entry 0 (mix) is itself a mix"),
    (["grpo", "grpo_opsd"], "entry 1 (grpo_opsd) is itself a mix"),
    ([{"method": "gear", "options": {"q_on": 2.0}}], "entry 0 (gear): q_on: must be <= 1.0"),
    ([{"method": "gear", "options": {"q_onn": 1}}], "entry 0 (gear): q_onn"),
    (["gear", "rlsd"], "components disagree on teacher_mode (gear: live, rlsd: frozen): one teacher pass serves all"),
    (["gear", "opsd"], "components disagree on teacher_context (gear: answer, opsd: solution)"),
    ([{"method": "gear", "options": {"teacher_mode": "frozen", "teacher_sync_every": 5}}, "rlsd"],
     "disagree on teacher_sync_every (gear: 5, rlsd: 10)"),
    (["oar_g", "oar_p"], "disagree on signal option 'pfinal_mode'"),
])
def test_bad_components_name_the_key(components, text):
    with pytest.raises(OptionError) as e:
        credit.build("mix", {"components": components})
    assert e.value.key == "assigner.options.components", str(e.value)
    assert text in e.value.message and "\n" not in e.value.message, e.value.message


def test_loss_mask_is_the_union():
    ef1 = {"method": "entropy_fork", "weight": 0.5}
    ef2 = {
        "method": "entropy_fork", "weight": 0.5, "options": {"rho": 0.3, "scope": "micro_batch", "micro_batch_size": 4}
    }
    mix = credit.build("mix", {"components": [ef1, ef2]})
    assert mix.labels == ["entropy_fork#0", "entropy_fork#1"]
    a1, a2 = credit.build("entropy_fork"), credit.build("entropy_fork", ef2["options"])
    b, (o1, o2, out) = _run(a1, a2, mix)
    m1, m2 = o1.loss_mask.bool(), o2.loss_mask.bool()
    assert not torch.equal(m1, m2) and torch.equal(out.loss_mask, m1 | m2)
    # a component adds nothing where it did not train the token
    torch.testing.assert_close(out.token_advantages, 0.5 * o1.token_advantages * m1 + 0.5 * o2.token_advantages * m2)
    assert {"entropy_fork#0/entropy_fork/frac_selected", "mix/entropy_fork#1_abs_share"} <= set(out.metrics)
    # a component without a loss mask trains every generated token, so the union is the response mask
    g = credit.build("mix", {"components": [{"method": "grpo", "weight": 0.5}, ef1]})
    b, (og, oe, out) = _run(credit.build("grpo"), a1, g, seed=1)
    assert torch.equal(out.loss_mask, b.response_mask.bool())
    outside = b.response_mask & ~oe.loss_mask.bool()
    torch.testing.assert_close(out.token_advantages[outside], 0.5 * og.token_advantages[outside])
    assert credit.build("mix", {"components": ["grpo", "opsd"]}).assign(
        b, _seq_adv(b), fake_signals(b, frozenset({Signal.LOGPROBS, Signal.TEACHER_LOGPROBS}), 1)).loss_mask is None


def test_teacher_signal_options_and_hooks_are_shared():
    r = credit.build("mix", {"components": ["grpo", {"method": "rlsd", "options": {"teacher_sync_every": 3}}]})
    assert (r.teacher_mode, r.teacher_sync_every, r.teacher_context) == ("frozen", 3, "answer")
    r.setup(seed=0, total_steps=40, task=TASK[False])
    r.on_step_end(7)
    assert r.state_dict() == {"components": [{}, {"steps_done": 7, "total_steps": 40}]}
    r2 = credit.build("mix", {"components": ["grpo", "rlsd"]})
    r2.load_state_dict(r.state_dict())
    assert r2.parts[1].steps_done == 7
    with pytest.raises(ValueError, match="component states"):
        credit.build("mix", {"components": ["rlsd"]}).load_state_dict(r.state_dict())
    plain = credit.build("mix", {"components": ["grpo", "entropy_fork"]})  # no teacher: the base class defaults
    assert (plain.teacher_mode, plain.teacher_context) == ("live", "answer") and plain.needs == {Signal.ENTROPY}
    o = credit.build("mix", {"components": ["grpo", "oar_g", "oar_g:q=0.5"]})
    assert o.signal_options() == credit.build("oar_g").signal_options() != {}
    e = credit.build("mix", {"components": [{"method": "gear", "options": {"teacher_mode": "ema"}}, "grpo"]})
    assert (e.teacher_mode, e.teacher_ema) == ("ema", 0.99)


def test_config_nodes_yamls_and_variants():
    from omegaconf import OmegaConf

    node = OmegaConf.create({"components": ["grpo", {"method": "gear:q_on=0.8", "weight": 2, "options": {"beta": 2}}]})
    a = credit.build("mix", dict(node))  # what the trainer passes: dict(cfg.assigner.options)
    assert a.components == ["grpo", {"method": "gear:q_on=0.8", "weight": 2, "options": {"beta": 2}}]
    assert a.weights == [1.0, 2.0] and (a.parts[1].q_on, a.parts[1].beta) == (0.8, 2.0)
    conf = {n: OmegaConf.to_container(OmegaConf.load(CONF / f"{n}.yaml")) for n in ("mix", "grpo_opsd", "gear_rlsd")}
    assert conf["mix"]["name"] == "mix" and conf["mix"]["options"] == conf["grpo_opsd"]["options"]
    assert conf["grpo_opsd"]["base"] == conf["gear_rlsd"]["base"] == "mix"
    v = build_method("grpo_opsd")
    assert isinstance(v, MixAssigner) and v.labels == ["grpo", "opsd"] and v.weights == [0.5, 0.5]
    gr = build_method("gear_rlsd")
    assert gr.labels == ["gear", "rlsd"] and gr.preserves_sign and not gr.preserves_mass
    assert (gr.teacher_mode, gr.teacher_sync_every, gr.teacher_context) == ("frozen", 10, "answer")
    assert credit.get("mix") is MixAssigner and build_method("mix").components == credit.build("mix").components
