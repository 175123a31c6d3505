"""The `shuffle` control (docs/credit/controls.md): another method's token advantages, permuted within each row."""
from __future__ import annotations

import pytest
import torch

from gearlab import credit
from gearlab.credit import Signal
from gearlab.credit.contract import _seq_adv, check_assigner, fake_signals, random_batch
from gearlab.credit.options import OptionError

from assigners.shuffle import ShuffleAssigner, row_seeds


def _inputs(seed: int = 0, multi_turn: bool = False, needs=None):
    b = random_batch(seed, multi_turn=multi_turn)
    adv = _seq_adv(b)
    needs = credit.build("gear").needs if needs is None else needs
    return b, adv, fake_signals(b, frozenset(needs), seed)


def _pair(of: str = "gear", seed: int = 0, **extra):
    """(inner output, shuffle output, batch) of the same method on the same inputs."""
    s = credit.build("shuffle", {"of": of, **extra})
    b, adv, sig = _inputs(seed, multi_turn=s.requires_turns, needs=s.needs)
    s.setup(seed=0, total_steps=10, task=type("T", (), {"multi_turn": s.requires_turns})())
    inner = s.inner.assign(b, adv, sig)
    return inner, s.assign(b, adv, sig), b, s


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shuffle_of_gear_is_a_per_row_permutation(seed):
    inner, out, b, _ = _pair("gear", seed)
    x, y = inner.token_advantages, out.token_advantages
    m = b.response_mask
    assert (y[~m] == 0).all()  # padding stays 0
    torch.testing.assert_close(y.double().sum(1), x.double().sum(1), atol=1e-5, rtol=0)  # per-row mass
    for i in range(b.batch_size):  # the same values in each row, in another order
        assert torch.equal(y[i][m[i]].sort().values, x[i][m[i]].sort().values)
        assert ((torch.sign(y[i][m[i]]) == torch.sign(x[i][m[i]])) | (y[i][m[i]] == 0)).all()
    moved = [i for i in range(b.batch_size) if not torch.equal(y[i], x[i])]
    nonuniform = [i for i in range(b.batch_size) if x[i][m[i]].unique().numel() > 1]
    assert moved == nonuniform and len(moved) >= 6  # every row with any structure is changed


def test_the_permutation_is_the_documented_one():
    """Row i: positions of response_mask permuted by torch.randperm(n, generator seeded with row_seeds(...)[i])."""
    inner, out, b, s = _pair("gear", 0, control_seed=3)
    seeds = row_seeds(b, 3)
    for i in range(b.batch_size):
        pos = b.response_mask[i].nonzero().flatten()
        perm = torch.randperm(pos.numel(), generator=torch.Generator().manual_seed(seeds[i]))
        want = torch.zeros_like(inner.token_advantages[i])
        want[pos] = inner.token_advantages[i][pos[perm]]
        assert torch.equal(out.token_advantages[i], want)


def test_same_row_same_permutation_wherever_it_sits():
    # gear's default scale is the group's: an absolute one makes each row's inner credit independent of the others
    s = credit.build("shuffle", {"of": "gear", "of_options": {"scale": "absolute"}})
    b, adv, sig = _inputs(1)
    out = s.assign(b, adv, sig)
    idx = torch.tensor([7, 2, 11, 0, 5])
    sub = s.assign(b.select(idx), adv[idx], {k: v[idx] for k, v in sig.items()})
    assert torch.equal(sub.token_advantages, out.token_advantages[idx])
    assert torch.equal(s.source_index(b.select(idx)), s.source_index(b)[idx])
    # padding is not part of the key: the same rows with 4 more pad positions
    wide = b.with_(response_ids=torch.cat([b.response_ids, torch.full((b.batch_size, 4), 9)], 1),
                   response_mask=torch.cat([b.response_mask, torch.zeros(b.batch_size, 4, dtype=torch.bool)], 1),
                   attention_mask=torch.cat([b.attention_mask, torch.zeros(b.batch_size, 4, dtype=torch.bool)], 1))
    assert torch.equal(s.source_index(wide)[:, :b.response_len], s.source_index(b))
    # the seed matters, and so do the row's tokens
    other = credit.build("shuffle", {"of": "gear", "control_seed": 1})
    assert not torch.equal(other.source_index(b), s.source_index(b))
    ids = b.response_ids.clone()
    ids[0, 0] += 1
    assert not torch.equal(s.source_index(b.with_(response_ids=ids))[0], s.source_index(b)[0])
    assert torch.equal(s.source_index(b.with_(response_ids=ids))[1:], s.source_index(b)[1:])


def test_row_seeds_are_gears_and_follow_the_documented_hash():
    import hashlib
    import struct

    import assigners.gear
    from gearlab.credit import seeding

    # one function seeds both randomised controls (gear's segmentation=random and shuffle): same row, same seed
    assert row_seeds is seeding.row_seeds and assigners.gear.row_seeds is seeding.row_seeds
    b = random_batch(4)
    seeds = row_seeds(b, 5)
    assert len(set(seeds)) == b.batch_size and set(seeds).isdisjoint(row_seeds(b, 6))  # rows and control seeds differ
    # the scheme of docs/credit/controls.md, written out for row 3
    p = b.prompt_ids[3][b.prompt_mask[3].bool()].tolist()
    r = b.response_ids[3][b.attention_mask[3].bool()].tolist()
    h = hashlib.blake2b(struct.pack("<q", 5) + struct.pack(f"<q{len(p)}q", len(p), *p) + struct.pack(f"<q{len(r)}q",
                        len(r), *r),
                        digest_size=8, person=b"gearlab-control")
    assert seeds[3] == int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def test_shuffle_of_grpo_is_grpo():
    b, adv, _ = _inputs(2)
    g = credit.build("grpo").assign(b, adv, {})
    s = credit.build("shuffle", {"of": "grpo"})
    assert s.needs == frozenset()
    out = s.assign(b, adv, {})
    assert torch.equal(out.token_advantages, g.token_advantages) and out.loss_mask is None


def test_loss_mask_moves_with_the_credit():
    inner, out, b, _ = _pair("entropy_fork", 0)
    assert inner.loss_mask is not None and out.loss_mask is not None
    m = b.response_mask
    eff_in = inner.token_advantages * inner.loss_mask.float()
    eff_out = out.token_advantages * out.loss_mask.float()
    for i in range(b.batch_size):
        assert int(out.loss_mask[i][m[i]].sum()) == int(inner.loss_mask[i][m[i]].sum())
        assert torch.equal(eff_out[i][m[i]].sort().values, eff_in[i][m[i]].sort().values)
    src = credit.build("shuffle", {"of": "entropy_fork"}).source_index(b)
    assert torch.equal(out.loss_mask, inner.loss_mask.gather(1, src))
    assert torch.equal(out.token_advantages, inner.token_advantages.gather(1, src))
    assert not torch.equal(out.loss_mask, inner.loss_mask)


def test_metrics_are_the_inner_ones_prefixed():
    inner, out, _, _ = _pair("gear", 0)
    assert out.metrics == {
        f"inner/{k}": v for k, v in inner.metrics.items()
    } and "inner/segments_per_seq" in out.metrics


def test_forwards_needs_promises_teacher_and_hooks():
    s = credit.build("shuffle")  # of: gear (the class default)
    assert s.needs == credit.build("gear").needs and s.preserves_sign and s.preserves_mass
    assert not hasattr(s, "last_segments")  # a shuffle has no segments to draw
    s = credit.build("shuffle", {"of": "gear", "of_options": {"normalisation": "group", "teacher_mode": "ema",
                                                               "divergence": "sampled"}})
    assert s.preserves_sign and not s.preserves_mass and s.teacher_mode == "ema"
    assert s.needs == {Signal.LOGPROBS, Signal.TEACHER_LOGPROBS, Signal.ENTROPY, Signal.REASONING_MASK}
    r = credit.build("shuffle", {"of": "rlsd", "of_options": "teacher_sync_every=3,lam=0.25"})
    assert (r.teacher_mode, r.teacher_sync_every, r.teacher_context, r.inner.lam) == ("frozen", 3, "answer", 0.25)
    assert r.preserves_sign and not r.preserves_mass
    r.setup(seed=0, total_steps=40, task=None)
    r.on_step_end(7)
    assert r.state_dict() == {"steps_done": 7, "total_steps": 40} == r.inner.state_dict()
    r2 = credit.build("shuffle", {"of": "rlsd"})
    r2.load_state_dict(r.state_dict())
    assert r2.inner.steps_done == 7
    o = credit.build("shuffle", {"of": "oar_g"})
    assert o.signal_options() == o.inner.signal_options() != {}
    t = credit.build("shuffle", {"of": "mt_grpo"})
    assert t.requires_turns and not t.keeps_zero_groups
    with pytest.raises(ValueError):
        t.setup(seed=0, total_steps=1, task=type("Single", (), {"multi_turn": False, "name": "x"})())
    v = credit.build("shuffle", {"of": "gear_random"})  # a variant
    assert v.inner.segmentation == "random"
    v = credit.build("shuffle", {"of": "gear:q_on=0.8,beta=2"})  # a grid label
    assert (v.inner.q_on, v.inner.beta) == (0.8, 2.0)


def test_of_options_from_a_config_node():
    from omegaconf import OmegaConf

    node = OmegaConf.create({"of": "gear", "of_options": {"q_on": 0.7, "segmentation": "fixed"}})
    s = credit.build("shuffle", dict(node))  # what the trainer passes: dict(cfg.assigner.options)
    assert (s.inner.q_on, s.inner.segmentation) == (0.7, "fixed")


@pytest.mark.parametrize("opts, key", [
    ({"of": "nope"}, "assigner.options.of"),
    ({"of": "shuffle"}, "assigner.options.of"),
    ({"of_options": {"q_onn": 1}}, "assigner.options.of_options.q_onn"),
    ({"of_options": {"q_on": 2.0}}, "assigner.options.of_options.q_on"),
    ({"of_options": "q_on"}, "assigner.options.of_options"),
    ({"of_options": 3}, "assigner.options.of_options"),
    ({"control_seed": "a"}, "assigner.options.control_seed"),
])
def test_bad_options_name_their_key(opts, key):
    with pytest.raises(OptionError) as e:
        credit.build("shuffle", opts)
    assert e.value.key == key, str(e.value)


@pytest.mark.parametrize("opts", [{}, {"of": "grpo"}, {"of": "gear_random"}, {"of": "gear_fixed"},
                                  {"of": "entropy_fork"},
                                  {"of": "mt_grpo"}, {"of": "rlsd"}, {"of": "gear", "control_seed": 9}])
def test_shuffle_passes_the_contract_kit(opts):
    checks = check_assigner("shuffle", opts)
    assert all(c.ok for c in checks), [(c.name, c.detail) for c in checks if not c.ok]
    names = {c.name for c in checks}
    inner = credit.build("shuffle", opts).inner
    if inner.preserves_sign:
        assert "sign preserved" in names
    if inner.preserves_mass:
        assert "mass preserved (Σ_t A_t = N·A)" in names


def test_class_and_yaml():
    from pathlib import Path

    from omegaconf import OmegaConf

    assert credit.get("shuffle") is ShuffleAssigner and "shuffle" in credit.available()
    conf = OmegaConf.to_container(OmegaConf.load(Path(__file__).parents[2] / "conf" / "assigner" / "shuffle.yaml"))
    assert conf == {"name": "shuffle", "options": {"of": "gear"}}
    a = credit.build("shuffle", conf["options"])
    assert (a.of, a.of_options, a.control_seed) == ("gear", {}, 0)
