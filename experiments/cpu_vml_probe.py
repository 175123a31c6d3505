"""Do torch's elementwise maths functions give the same bits on two CPU classes? (They go through MKL's VM library.)

ATen computes float ``sqrt``, ``exp``, ``log``, ``tanh``, ``sin``, ``cos``, ... of contiguous CPU tensors with MKL's
vector maths (``at::vml``, accuracy mode HA), not with its own pinned vector code; MKL picks the code path by CPU.
This applies each function to 2^20 fixed inputs (torch's seeded CPU generator: the same on every CPU) in several
forms and prints one JSON line: form -> SHA-256 of the float32 outputs. Each environment variant runs in its own
process (``--variant``, below). Run it on two machines with the same torch; ``--dump`` also saves the raw outputs of
``sqrt`` and ``exp`` to find the differing elements.

    python experiments/cpu_vml_probe.py [--dump DIR] [--cbwr SSE4_2 --cbwr AVX2,STRICT ...]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

VARIANTS = {
    "pinned": {},  # gearlab's default (import gearlab sets MKL_CBWR=COMPATIBLE, ATen AVX2)
    "strict": {"MKL_CBWR": "COMPATIBLE,STRICT"},
    "avx2_instr": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "sse42_instr": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}


def _h(t) -> str:  # noqa: ANN001
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:12]


def probe(dump: Path | None) -> dict[str, str]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import gearlab  # noqa: F401
    import torch

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    n = 1 << 20
    pos = torch.rand(n, generator=g) * 4.0 + 1e-6   # variances, probabilities
    wide = (torch.rand(n, generator=g) - 0.5) * 40.0  # log-ratios, logits
    out: dict[str, str] = {}
    fns = {"sqrt": (torch.sqrt, pos), "exp": (torch.exp, wide), "log": (torch.log, pos), "tanh": (torch.tanh, wide),
           "sin": (torch.sin, wide), "cos": (torch.cos, wide), "rsqrt": (torch.rsqrt, pos),
           "reciprocal": (torch.reciprocal, pos), "sigmoid": (torch.sigmoid, wide), "log2": (torch.log2, pos),
           "erf": (torch.erf, wide), "pow0.5": (lambda x: x.pow(0.5), pos), "log1p": (torch.log1p, pos),
           "expm1": (torch.expm1, wide)}
    for name, (fn, x) in fns.items():
        y = fn(x)
        out[name] = _h(y)
        out[name + "@f64"] = _h(fn(x.double()).float())
        out[name + "@strided"] = _h(fn(x.view(-1, 2)[:, 0]))  # not contiguous: ATen copies into a buffer first
        if dump is not None and name in ("sqrt", "exp", "log"):
            dump.mkdir(parents=True, exist_ok=True)
            y.numpy().tofile(dump / f"{name}.f32")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant")
    ap.add_argument("--dump", type=Path)
    ap.add_argument("--cbwr", action="append", default=[], help="also run with MKL_CBWR=VALUE (repeatable)")
    a = ap.parse_args()
    variants = dict(VARIANTS, **{f"cbwr={c}": {"MKL_CBWR": c} for c in a.cbwr})
    if a.variant:
        os.environ.update(variants[a.variant])
        print(json.dumps(probe(a.dump if a.variant == "pinned" else None)))
        return
    res = {}
    for v in variants:
        args = [sys.executable, __file__, "--variant", v, *[f"--cbwr={c}" for c in a.cbwr]]
        args += ["--dump", str(a.dump)] if a.dump else []
        res[v] = json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)
    import platform
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    print(json.dumps({"cpu_model": cpu, "results": res}, indent=1))


if __name__ == "__main__":
    main()
