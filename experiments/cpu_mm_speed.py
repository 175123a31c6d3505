"""The time of the embedded model's matrix products under the MKL branch in force (``MKL_CBWR``), one thread.

Shapes: a decode step of 128 rows ([128, 192] x [192, 512]) and an update micro-batch forward and backward
([2048, 192] x [192, 512]). Prints one line: the branch, then milliseconds per product.

    MKL_CBWR=SSE4_2 python experiments/cpu_mm_speed.py
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gearlab  # noqa: E402,F401  (pins the kernels; a MKL_CBWR the user set is kept)
import torch  # noqa: E402


def per_call_ms(f, n: int) -> float:  # noqa: ANN001
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 192, generator=g, requires_grad=True)
    x, xl = torch.randn(128, 192, generator=g), torch.randn(2048, 192, generator=g, requires_grad=True)

    def fwd_bwd() -> None:
        torch.nn.functional.linear(xl, w).sum().backward()

    dec = per_call_ms(lambda: torch.nn.functional.linear(x, w.detach()), 400)
    upd = per_call_ms(fwd_bwd, 40)
    print(f"MKL_CBWR={os.environ.get('MKL_CBWR')} decode_128x192x512_ms={dec:.3f} "
          f"update_2048x192x512_fwd_bwd_ms={upd:.3f}")


if __name__ == "__main__":
    main()
