"""Methods = a registered assigner + options: variants (conf/assigner/*.yaml with a base) and grid points."""
from __future__ import annotations

import pytest

from gearlab.config import ConfigError, load_config, parse_label
from gearlab.credit.methods import available_methods, build_method, expand_grid, grid_label, method_spec


@pytest.fixture
def conf(tmp_path, monkeypatch):
    """A conf dir with a registered assigner's YAML, a variant of it and a variant of the variant."""
    from gearlab.config import conf_dir

    real = conf_dir()
    for group in ("experiment", "task", "model"):
        (tmp_path / group).symlink_to(real / group)
    a = tmp_path / "assigner"
    a.mkdir()
    (a / "grpo.yaml").write_text("name: grpo\noptions: {}\n")
    (a / "entropy_adv.yaml").write_text("name: entropy_adv\noptions: {alpha: 0.2}\n")
    (a / "ea_strong.yaml").write_text("name: ea_strong\nbase: entropy_adv\noptions: {kappa: 3.0}\n")
    (a / "ea_stronger.yaml").write_text("name: ea_stronger\nbase: ea_strong\noptions: {alpha: 0.5}\n")
    monkeypatch.setenv("GEARLAB_CONF_DIR", str(tmp_path))
    return tmp_path


def test_parse_and_build_labels():
    assert parse_label("gear") == ("gear", {})
    assert parse_label("gear:q_on=0.8,beta=2,exclude_answer_span=true") == (
        "gear", {"q_on": 0.8, "beta": 2, "exclude_answer_span": True})
    assert grid_label("gear", {"q_on": 0.8, "onset_local_max": False}) == "gear:q_on=0.8,onset_local_max=false"
    with pytest.raises(ConfigError, match="not KEY=VALUE"):
        parse_label("gear:q_on")


def test_variant_inherits_its_base_options(conf):
    assert method_spec("ea_strong").base == "entropy_adv"
    assert method_spec("ea_strong").options == {"alpha": 0.2, "kappa": 3.0}
    deeper = method_spec("ea_stronger")
    assert (deeper.base, deeper.options) == ("entropy_adv", {"alpha": 0.5, "kappa": 3.0})
    grid = method_spec("ea_strong:kappa=9")
    assert grid.name == "ea_strong:kappa=9" and grid.options == {"alpha": 0.2, "kappa": 9}
    a = build_method("ea_stronger")
    assert type(a).name == "entropy_adv" and a.alpha == 0.5 and a.kappa == 3.0
    assert {"ea_strong", "ea_stronger", "grpo", "gear"} <= set(available_methods())


def test_a_variant_is_its_own_method_in_the_config(conf):
    cfg = load_config(["assigner=ea_strong"])
    assert (cfg.assigner.name, cfg.assigner.base) == ("ea_strong", "entropy_adv")
    assert dict(cfg.assigner.options) == {"alpha": 0.2, "kappa": 3.0}
    cfg = load_config(["assigner=ea_strong:alpha=0.7"])
    assert cfg.assigner.name == "ea_strong:alpha=0.7" and cfg.assigner.options.alpha == 0.7
    cfg = load_config(["assigner=grpo"])
    assert (cfg.assigner.name, cfg.assigner.base) == ("grpo", "grpo")


def test_unknown_method():
    with pytest.raises(KeyError, match="unknown method 'nope'"):
        method_spec("nope")


def test_expand_grid():
    assert expand_grid(["grpo", "gear"], {"gear": {"q_on": [0.8, 0.9]}}) == ["grpo", "gear:q_on=0.8", "gear:q_on=0.9"]
    two = expand_grid(["grpo"], {"gear": {"q_on": [0.8, 0.9], "beta": [1, 2]}})
    assert two == [
        "grpo", "gear:q_on=0.8,beta=1", "gear:q_on=0.8,beta=2", "gear:q_on=0.9,beta=1", "gear:q_on=0.9,beta=2"
    ]
    assert expand_grid(["grpo"], {"gear": {"q_on": 0.8}}) == ["grpo", "gear:q_on=0.8"]


def test_preflight_refuses_a_bad_grid_option():
    from gearlab.trainer.preflight import preflight

    with pytest.raises(ConfigError, match="assigner.options.q_on"):
        preflight(load_config(["assigner=gear:q_on=2.0", "model.name_or_path=embedded:tiny-random"]))
