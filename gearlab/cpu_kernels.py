"""One instruction set for every CPU kernel gearlab runs, so a CPU run gives the same digits on any x86-64 machine.

torch's CPU kernels are picked per machine: ATen's vectorised kernels by the widest instruction set the CPU has
(AVX-512 on an AMD EPYC Zen 4 or an Intel Xeon Sapphire Rapids, AVX2 on most laptops), MKL's matrix products and
vector maths by the CPU's vendor and instruction set. Kernels that add in another order round differently, and a
small model trained by RL is chaotic in rounding: one flipped sampled token and two machines print different tables.

:func:`pin` fixes them through the environment variables each library reads at its first dispatch (so it must run
before torch computes anything; ``import gearlab`` does it):

- ``ATEN_CPU_CAPABILITY=avx2``: ATen's kernels (element-wise maths, reductions, softmax, SDPA's CPU kernel) take
  their AVX2 build, which every x86-64 CPU of the last decade runs;
- ``MKL_CBWR=COMPATIBLE``: MKL's matrix products (SDPA's inner products, ``F.linear`` outside ``nn.Linear``) and
  vector maths (``torch.exp``/``log``) take MKL's generic branch. It is the only branch MKL runs alike on Intel and
  AMD: with ``MKL_CBWR=AVX2`` (also ``AVX2,STRICT``) an Intel Xeon and an AMD EPYC still disagree on ``exp``,
  ``log`` and a [1536, 64] × [64, 1024] product (experiments/cpu_op_probe.py; results in
  experiments/results/cpu_classes/);
- ``ONEDNN_MAX_CPU_ISA=AVX2``: oneDNN's JIT, which :func:`route_linear` sends every float32 ``nn.Linear`` on the CPU
  to: its AVX2 matrix product adds each output's terms in one fixed order whatever the CPU, and is 2-3x faster than
  MKL's generic branch at the tiny model's shapes (experiments/results/cpu_classes/).

One more kernel is vendor-dependent whatever the variables: the for-each AdamW step (its square root). gearlab's
optimisers use the fused AdamW kernel, which gave the same digits on both classes.

Measured (experiments/results/cpu_classes/): with the pin and the route, an AMD EPYC and an Intel Xeon give bitwise
the same warm start, the same first RL iterations and the same ten final models of the main job (torch 2.11 on
both); with the machine's own kernels they do not. oneDNN's version is part of the digits (torch 2.11 and 2.13 ship
different ones), so it is recorded too.

``GEARLAB_CPU_KERNELS=native`` keeps the machine's own kernels and torch's own ``nn.Linear`` (other digits); a
variable the user set is kept. What was in force is recorded with every run (:func:`describe`, ``versions.*``).
GPU kernels are not affected.
"""
from __future__ import annotations

import os
import platform
import sys

__all__ = ["PINNED", "pin", "pinned", "route_linear", "describe", "cpu_model"]

# variable -> value; each library reads its variable once, at its first dispatch
PINNED: dict[str, str] = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"}
OPT_OUT = "GEARLAB_CPU_KERNELS"  # "native": do not pin


def pin() -> bool:
    """Set :data:`PINNED` in ``os.environ`` (keeping any value the user set) on x86-64, unless
    ``GEARLAB_CPU_KERNELS=native``. Returns whether the pin is requested. Child processes inherit it."""
    if not pinned():
        return False
    for k, v in PINNED.items():
        os.environ.setdefault(k, v)
    return True


def pinned() -> bool:
    """Whether this process runs with the pin (x86-64 and no ``GEARLAB_CPU_KERNELS=native``)."""
    return os.environ.get(OPT_OUT, "").lower() != "native" and platform.machine().lower() in ("x86_64", "amd64")


_ROUTED: list[bool] = []  # [True] once nn.Linear is routed in this process


def route_linear() -> bool:
    """Send ``nn.Linear`` on CPU float32 tensors to oneDNN's matrix product (forward and both backward products),
    when pinned and torch has oneDNN; anything else (GPU, other dtypes, tensor subclasses such as DTensor, a
    ``torch.compile`` trace, CPU autocast, which casts a Linear to bfloat16 only on torch's own path) keeps torch's
    own path. Idempotent; returns whether the route is in force.

    Why: MKL's ``COMPATIBLE`` branch is the only MKL branch that adds alike on Intel and AMD, and it is slow (0.6 ms
    against 0.26 for a [128, 192] x [192, 512] product on an AMD EPYC). oneDNN's AVX2 kernel (``ONEDNN_MAX_CPU_ISA``)
    is one JIT code on every x86-64 CPU and accumulates each output over k in order, so its digits do not depend
    on the vendor or on cache-size blocking. The weight gradient is ``dY^T X`` and the input gradient
    ``dY W``, both through the same product on transposed views."""
    if _ROUTED:
        return True
    if not pinned():
        return False
    import torch
    from torch import nn

    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    op = torch.ops.mkldnn._linear_pointwise

    def product(x: "torch.Tensor", w: "torch.Tensor", b: "torch.Tensor | None" = None) -> "torch.Tensor":
        """x [..., K] times w [N, K]^T (+ b [N]) -> [..., N]."""
        y = op(x.reshape(-1, x.shape[-1]), w, b, "none", [], "")  # transposed views are read in place
        return y.reshape(*x.shape[:-1], w.shape[0])

    class OneDNNLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, b):  # noqa: ANN001, ANN205
            ctx.save_for_backward(x, w)
            ctx.has_bias = b is not None
            return product(x, w, b)

        @staticmethod
        def backward(ctx, gy):  # noqa: ANN001, ANN205
            x, w = ctx.saved_tensors
            g2 = gy.reshape(-1, gy.shape[-1])
            gx = product(gy, w.t()) if ctx.needs_input_grad[0] else None
            gw = product(g2.t(), x.reshape(-1, x.shape[-1]).t()) if ctx.needs_input_grad[1] else None
            gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
            return gx, gw, gb

    plain = (torch.Tensor, nn.Parameter)
    torch_forward = nn.Linear.forward

    def forward(self: nn.Linear, x: "torch.Tensor") -> "torch.Tensor":
        w, b = self.weight, self.bias
        if (x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32
                and type(x) is torch.Tensor and type(w) in plain and (b is None or type(b) in plain)
                and x.numel() > 0 and not torch.compiler.is_compiling() and not torch.is_autocast_enabled("cpu")):
            if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)):
                return OneDNNLinear.apply(x, w, b)
            return product(x, w, b)
        return torch_forward(self, x)

    nn.Linear.forward = forward
    _ROUTED.append(True)
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
    """What decides a CPU run's digits: ``cpu_model``, the pinned variables' values (``""`` = not set),
    ``cpu_linear`` (``onednn`` once :func:`route_linear` is in force, else ``torch``) and — when torch is loaded —
    ``cpu_capability``, the instruction set ATen actually dispatches to, and ``onednn``, oneDNN's version."""
    out = {"cpu_model": cpu_model(), "cpu_kernels": os.environ.get(OPT_OUT, "pinned") or "pinned"}
    out.update({k.lower(): os.environ.get(k, "") for k in PINNED})
    out["cpu_linear"] = "onednn" if _ROUTED else "torch"
    torch = sys.modules.get("torch")
    if torch is not None:
        out["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        # oneDNN's version decides the routed product's digits (torch 2.11 ships v3.10.2, 2.13 v3.12.0)
        out["onednn"] = next((w for line in torch.__config__.show().splitlines() if "MKL-DNN" in line
                              for w in line.split() if w.startswith("v3") or w.startswith("v4")), "")
    return out
