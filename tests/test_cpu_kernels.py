"""gearlab.cpu_kernels: importing gearlab pins torch's CPU kernels before anything runs; the opt-out keeps them."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gearlab import cpu_kernels

PROBE = ("import json, gearlab, torch; from gearlab.cpu_kernels import describe; torch.ones(3).exp(); "
         "print(json.dumps(describe()))")


def _describe_in_child(**env: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if k not in (*cpu_kernels.PINNED, cpu_kernels.OPT_OUT)}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(cpu_kernels.platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 only")
def test_import_gearlab_pins_every_dispatcher():
    d = _describe_in_child()
    assert d["cpu_capability"] == "AVX2"  # what ATen actually dispatches to, not only the variable
    assert (d["aten_cpu_capability"], d["mkl_cbwr"], d["onednn_max_cpu_isa"]) == ("avx2", "COMPATIBLE", "AVX2")
    assert d["cpu_kernels"] == "pinned" and d["cpu_model"] not in ("", "unknown")


@pytest.mark.skipif(cpu_kernels.platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 only")
def test_native_opt_out_and_user_values_are_kept():
    d = _describe_in_child(GEARLAB_CPU_KERNELS="native")
    assert d["cpu_kernels"] == "native" and d["mkl_cbwr"] == "" and d["aten_cpu_capability"] == ""
    d = _describe_in_child(MKL_CBWR="AVX2")
    assert d["mkl_cbwr"] == "AVX2" and d["aten_cpu_capability"] == "avx2"  # the user's value wins, the rest pinned
