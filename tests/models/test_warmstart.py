"""The embedded warm start pinned to the README's figure.

Every number of the main job starts from this checkpoint, and its held-out accuracy moves with anything that
changes floating-point rounding (a dependency version, the thread count: seed 0 gives 20.0% with 2 threads and
42.5% with 1, same packages). With the committed lock (locks/cpu.txt) and `warmstart.threads` it is
deterministic; this test makes a drift fail CI instead of silently changing every result downstream.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# README, "Two commands": the warm start's seed-0 held-out greedy accuracy on 200 problems, in percent
README_GREEDY = 20.0
# ±5 points: about 1.6 binomial standard errors at n = 200 — a new environment that lands outside it has moved
# the starting point of every comparison, and the README's figures must be re-measured (locks/update.sh)
BAND = 5.0


def test_readme_states_the_pinned_figure():
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"warm-start[^\n]*?\*\*([0-9.]+)%\*\* greedy", readme, flags=re.S)
    assert m, "README no longer states the warm start's greedy accuracy in the expected form"
    assert float(m.group(1)) == README_GREEDY


@pytest.mark.slow
def test_embedded_warmstart_stays_in_the_readme_band(tmp_path):
    out = subprocess.run([sys.executable, "-m", "gearlab.cli", "warmstart", f"trainer.output_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads((tmp_path / "embedded" / "tiny-arith" / "warmstart.json").read_text())
    assert res["threads"] == 2 and res["steps"] == 450 and res["n_eval"] == 200
    acc = 100 * res["acc_plain_greedy"]
    assert abs(acc - README_GREEDY) <= BAND, (
        f"seed-0 warm start reached {acc:.1f}% held-out greedy accuracy; the README states {README_GREEDY}% "
        f"(band ±{BAND}). Dependencies or numerics moved: re-measure the README's figures.")
