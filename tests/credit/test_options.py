"""Typed assigner options: every assigner declares a dataclass, bad values are one line naming
`assigner.options.<key>` (exit 2, before any work), and `gearlab assigners NAME` prints the options."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from gearlab import credit
from gearlab.credit.options import OptionError, describe_options, option, parse_options


@dataclasses.dataclass
class Opts:
    rate: float = option(0.5, "a rate", lo=0.0, hi=1.0, hi_open=True)
    steps: int = option(3, "a count", lo=1)
    mode: str = option("a", "a mode", choices=("a", "b"))
    flag: bool = option(False, "a flag")
    cap: float | None = option(None, "an optional cap", lo=0.0, lo_open=True)


def test_parse_options_types_ranges_choices_and_unknown_keys():
    o = parse_options(Opts, {"rate": 0, "steps": 2, "mode": "b", "flag": True, "cap": 3}, "demo")
    assert (o.rate, o.steps, o.mode, o.flag, o.cap) == (0.0, 2, "b", True, 3.0) and isinstance(o.rate, float)
    assert parse_options(Opts, None, "demo") == Opts()
    for bad, key, text in [({"rate": 1.0}, "rate", "must be < 1.0"), ({"rate": "x"}, "rate", "expected float"),
                           ({"steps": 2.5}, "steps", "expected int"), ({"steps": True}, "steps", "expected int"),
                           ({"steps": 0}, "steps", "must be >= 1"), ({"mode": "c"}, "mode", "is not one of a, b"),
                           ({"flag": "yes"}, "flag", "expected bool"), ({"cap": 0}, "cap", "must be > 0.0"),
                           ({"rate": float("nan")}, "rate", "nan"), ({"speed": 1}, "speed", "has no option 'speed'")]:
        with pytest.raises(OptionError) as e:
            parse_options(Opts, bad, "demo")
        assert e.value.key == f"assigner.options.{key}" and text in str(e.value), (bad, str(e.value))
    rows = describe_options(Opts)
    assert rows[0] == ("rate", "float", 0.5, "a rate") and rows[2][3] == "a mode [a | b]"


def test_every_assigner_declares_typed_options_with_docs():
    bundled = [n for n in credit.available() if credit.get(n).__module__.startswith("gearlab.assigners.")]
    assert len(bundled) >= 10
    for name in bundled:
        cls = credit.get(name)
        if name == "grpo":
            assert cls.Options is None and credit.build("grpo").options is None
            continue
        assert dataclasses.is_dataclass(cls.Options), name
        for opt, tp, default, doc in describe_options(cls.Options):
            assert doc, f"{name}.{opt} has no doc"
        a = credit.build(name)  # defaults come from the dataclass alone
        for f in dataclasses.fields(cls.Options):
            assert getattr(a, f.name) == (f.default if f.default is not dataclasses.MISSING else f.default_factory())


@pytest.mark.parametrize("override, key, text", [
    ("assigner.options.q_on=1.5", "assigner.options.q_on", "must be <= 1.0, got 1.5"),
    ("assigner.options.q_on=high", "assigner.options.q_on", "expected float, got 'high'"),
    ("assigner.options.divergence=topk", "assigner.options.divergence", "is not one of full_kl, sampled"),
    ("assigner.options.qon=0.5", "assigner.options.qon", "assigner 'gear' has no option 'qon'"),
])
def test_bad_option_is_one_line_exit_2_before_any_work(tmp_path, override, key, text):
    out = subprocess.run([sys.executable, "-m", "gearlab.cli", "train", "assigner=gear", override,
                          f"trainer.output_dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert f"key '{key}'" in lines[0] and text in lines[0], lines[0]
    assert not any(tmp_path.iterdir())


def test_assigners_command_prints_options():
    out = subprocess.run([sys.executable, "-m", "gearlab.cli", "assigners", "rlsd"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "lam" in out.stdout and "0.5" in out.stdout and "peak weight" in out.stdout
    assert "clip_eps" in out.stdout and "needs: logprobs, teacher_logprobs" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "gearlab.cli", "assigners", "nope"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "unknown method 'nope'" in bad.stderr and "gear_random" in bad.stderr
    # a variant is described through its base, with its options
    var = subprocess.run([sys.executable, "-m", "gearlab.cli", "assigners", "gear_random"], capture_output=True,
                         text=True, timeout=120)
    assert var.returncode == 0 and (
        "gear_random: a variant of gear with options {'segmentation': 'random'}"
    ) in var.stdout
    listing = subprocess.run(
        [sys.executable, "-m", "gearlab.cli", "assigners"], capture_output=True, text=True, timeout=120
    )
    assert "gear_fixed     = gear {'segmentation': 'fixed'}" in listing.stdout
