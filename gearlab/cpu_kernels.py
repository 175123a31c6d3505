"""One instruction set for every CPU kernel gearlab runs, so a CPU run gives the same digits on any x86-64 machine.

torch's CPU kernels are picked per machine: ATen's vectorised kernels by the widest instruction set the CPU has
(AVX-512 on an AMD EPYC Zen 4 or an Intel Xeon Sapphire Rapids, AVX2 on most laptops), MKL's matrix products and
vector maths by the CPU's vendor and instruction set. Kernels that add in another order round differently, and a
small model trained by RL is chaotic in rounding: one flipped sampled token and two machines print different tables.

:func:`pin` fixes them through the environment variables each library reads at its first dispatch (so it must run
before torch computes anything; ``import gearlab`` does it):

- ``ATEN_CPU_CAPABILITY=avx2``: ATen's kernels (element-wise maths, reductions, softmax, SDPA's CPU kernel) take
  their AVX2 build, which every x86-64 CPU of the last decade runs;
- ``MKL_CBWR=COMPATIBLE``: MKL's matrix products (``F.linear``, SDPA's inner products) and vector maths
  (``torch.exp``/``log``) take MKL's generic branch. It is the only branch MKL runs alike on Intel and AMD: with
  ``MKL_CBWR=AVX2`` (also ``AVX2,STRICT``) an Intel Xeon and an AMD EPYC still disagree on ``exp``, ``log`` and a
  [1536, 64] × [64, 1024] product (experiments/cpu_op_probe.py; results in experiments/results/cpu_classes/);
- ``ONEDNN_MAX_CPU_ISA=AVX2``: oneDNN's JIT (not on gearlab's fp32 path; pinned in case a future op uses it).

One more kernel is vendor-dependent whatever the variables: the for-each AdamW step (its square root). gearlab's
optimisers use the fused AdamW kernel, which gave the same digits on both classes.

Measured (experiments/cpu_class_gearlab.py: a warm start, then two GEAR iterations): an AMD EPYC and an Intel Xeon
print the same weights digest and every logged metric to the last digit when pinned, and other digits when not.
Cost on the AMD EPYC: the warm start's 450 SFT steps take about 2× longer (MKL's generic matrix product); the main
job starts from a shipped warm start (gearlab.models.shipped), so its figures do not pay for that.

``GEARLAB_CPU_KERNELS=native`` keeps the machine's own kernels (faster, other digits); a variable the user set is
kept. What was in force is recorded with every run (:func:`describe`, ``versions.*``). GPU kernels are not affected.
"""
from __future__ import annotations

import os
import platform
import sys

__all__ = ["PINNED", "pin", "describe", "cpu_model"]

# variable -> value; each library reads its variable once, at its first dispatch
PINNED: dict[str, str] = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"}
OPT_OUT = "GEARLAB_CPU_KERNELS"  # "native": do not pin


def pin() -> bool:
    """Set :data:`PINNED` in ``os.environ`` (keeping any value the user set) on x86-64, unless
    ``GEARLAB_CPU_KERNELS=native``. Returns whether the pin is requested. Child processes inherit it."""
    if os.environ.get(OPT_OUT, "").lower() == "native" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    for k, v in PINNED.items():
        os.environ.setdefault(k, v)
    return True


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else ``platform.processor()``), e.g. "AMD EPYC"."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def describe() -> dict[str, str]:
    """What decides a CPU run's digits: ``cpu_model``, the pinned variables' values (``""`` = not set), and —
    when torch is loaded — ``cpu_capability``, the instruction set ATen actually dispatches to."""
    out = {"cpu_model": cpu_model(), "cpu_kernels": os.environ.get(OPT_OUT, "pinned") or "pinned"}
    out.update({k.lower(): os.environ.get(k, "") for k in PINNED})
    torch = sys.modules.get("torch")
    if torch is not None:
        out["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return out
