"""The command line's own help: per-command config keys (``--help``), the resolved config (``--print-config``)
and an assigner's option docs (``gearlab assigners NAME``)."""
from __future__ import annotations

import dataclasses
import re

import pytest
import yaml
from omegaconf import OmegaConf

from gearlab.cli import COMMAND_SECTIONS, main
from gearlab.config import Config, conf_dir


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_train_help_lists_its_keys_with_type_default_and_doc(capsys):
    rc, out, _ = _run(capsys, "train", "--help")
    assert rc == 0
    # one row: key, type, default, then the comment written beside the field in gearlab/config_schema.py
    assert re.search(r"^  optim\.lr +float += 0\.0001 +right for the 1\.2M-param embedded model; use ~1e-6", out, re.M)
    # a comment above a field is its doc too (two lines, joined)
    row = next(ln for ln in out.splitlines() if ln.startswith("  model.name_or_path "))
    assert "'embedded:tiny-arith'" in row and '"embedded:tiny-arith" = the warm-started tiny model' in row
    # nested sections are flattened; optional types read as written
    assert re.search(r"^  rollout\.fast\.compile +bool \| None += None ", out, re.M)
    # choices the comment does not list come from the validator's table
    assert re.search(r"^  algorithm\.agg .*\[token-mean \| seq-mean-token-mean", out, re.M)
    # only the sections train reads
    assert "\ncompare:" not in out and "compare.seeds" not in out and "export.out" not in out
    rc, out, _ = _run(capsys, "compare", "--help")
    assert rc == 0 and re.search(r"^  compare\.seeds +list\[int\] += \[0, 1, 2\]", out, re.M) and "  optim.lr " in out


def test_every_command_help_names_real_sections_and_every_section_is_read_by_some_command(capsys):
    sections = {f.name for f in dataclasses.fields(Config)}
    used = {s for secs in COMMAND_SECTIONS.values() for s in secs}
    assert used == sections
    for cmd, secs in COMMAND_SECTIONS.items():
        rc, out, _ = _run(capsys, cmd, "--help")
        assert rc == 0 and out.startswith(f"usage: gearlab {cmd}")
        assert [s for s in secs if f"\n{s}:" not in out] == []


def test_new_assigner_help_says_what_it_writes_outside_a_checkout(capsys):
    rc, out, _ = _run(capsys, "new-assigner", "--help")
    assert rc == 0
    text = " ".join(out.split())
    assert "assigners/NAME.py" in text and "./NAME.py, ./conf/assigner/NAME.yaml and ./tests/test_NAME.py" in text


def test_print_config_reflects_experiment_and_overrides_and_runs_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc, out, err = _run(capsys, "train", "experiment=embedded", "optim.lr=3e-4", "--print-config")
    assert rc == 0, err
    cfg = yaml.safe_load(out)
    assert cfg["optim"]["lr"] == pytest.approx(3e-4)  # the override beats the experiment's 1e-4
    experiment = OmegaConf.to_container(OmegaConf.load(conf_dir() / "experiment" / "embedded.yaml"))
    assert experiment["trainer"]["max_steps"] != Config().trainer.max_steps  # else the next line proves nothing
    assert cfg["trainer"]["max_steps"] == experiment["trainer"]["max_steps"]
    assert cfg["eval"]["num_problems"] == experiment["eval"]["num_problems"]
    assert list(tmp_path.iterdir()) == []  # no runs/, no mlflow.db, no warm-started model


def test_print_config_applies_command_short_forms_and_rejects_bad_keys(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc, out, _ = _run(capsys, "compare", "seeds=[3,4]", "assigners=[grpo,shuffle]", "--print-config")
    assert rc == 0
    assert yaml.safe_load(out)["compare"]["seeds"] == [3, 4]
    assert yaml.safe_load(out)["compare"]["assigners"] == ["grpo", "shuffle"]
    rc, out, err = _run(capsys, "train", "optim.lrr=1", "--print-config")
    assert rc == 2 and out == "" and "optim.lrr" in err
    assert list(tmp_path.iterdir()) == []


def test_rlsd_warmup_help_describes_the_ramp(capsys):
    rc, out, _ = _run(capsys, "assigners", "rlsd")
    assert rc == 0
    row = next(ln for ln in out.splitlines() if ln.strip().startswith("warmup_steps "))
    # the code ramps λ linearly (λ·g/warmup_steps), it never runs plain GRPO during the warm-up
    assert "ramps up linearly" in row and "λ·g/warmup_steps" in row and "plain GRPO" not in row


def test_a_reader_that_leaves_early_gets_no_traceback():
    """``gearlab assigners | head -1``: the reader is gone before gearlab writes (here, from the start, so that no
    timing decides it); gearlab ends with 141 (128 + SIGPIPE, as the shell reports it) and nothing on stderr,
    instead of a BrokenPipeError traceback."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)
    proc = subprocess.Popen([sys.executable, "-m", "gearlab.cli", "assigners"], stdout=write_end,
                            stderr=subprocess.PIPE, text=True)
    os.close(write_end)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert err == ""
