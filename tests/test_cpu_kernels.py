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


@pytest.mark.skipif(not cpu_kernels.pinned(), reason="the route is part of the pin (x86-64, not opted out)")
def test_cpu_linear_goes_through_onednn_with_torchs_values_and_gradients():
    import torch
    import torch.nn.functional as F

    import gearlab.core  # noqa: F401  (installs the route)

    assert cpu_kernels.describe()["cpu_linear"] == "onednn"
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(192, 319)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(319, 192, generator=g) / 14)
        lin.bias.copy_(torch.randn(319, generator=g))
    x = torch.randn(4, 44, 192, generator=g, requires_grad=True)
    y = lin(x)
    (y.square().sum() + y[..., :7].sum()).backward()
    routed = (y.detach(), x.grad, lin.weight.grad, lin.bias.grad)
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, lin.weight, lin.bias))
    y2 = F.linear(x2, w2, b2)  # torch's own product (MKL)
    (y2.square().sum() + y2[..., :7].sum()).backward()
    for a, b in zip(routed, (y2.detach(), x2.grad, w2.grad, b2.grad)):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-4)
    assert not torch.equal(routed[0], y2.detach())  # another kernel, other rounding: the route is really taken
    with torch.no_grad():  # no autograd: the same product, the same digits
        assert torch.equal(lin(x), routed[0])
    lin64 = torch.nn.Linear(8, 3).double()  # other dtypes keep torch's path
    x64 = torch.randn(5, 8, dtype=torch.float64, generator=g)
    assert torch.equal(lin64(x64), F.linear(x64, lin64.weight, lin64.bias))


@pytest.mark.skipif(not cpu_kernels.pinned(), reason="the route is part of the pin (x86-64, not opted out)")
def test_cpu_linear_digits_do_not_depend_on_the_thread_count():
    """oneDNN's product adds each output's terms in one order (no split of the sum over threads): the warm start's 2
    threads and a child's 1 thread run the same kernel arithmetic."""
    import torch

    import gearlab.core  # noqa: F401

    threads = torch.get_num_threads()
    out = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            g = torch.Generator().manual_seed(1)
            lin = torch.nn.Linear(512, 192, bias=False)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(192, 512, generator=g))
            x = torch.randn(1408, 512, generator=g, requires_grad=True)
            y = lin(x)
            y.square().sum().backward()
            out[n] = (y.detach(), x.grad, lin.weight.grad)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(out[1], out[2]))
