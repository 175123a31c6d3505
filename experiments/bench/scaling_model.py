"""The scaling table of issue 8 from the measured JSONs, plus a fitted model that predicts the GPU counts
that could not be run.

    python experiments/bench/scaling_model.py experiments/bench/results/scaling_h200x4 > table.md

Models (least squares over the measured points of each shape; stated, not derived from first principles):
- memory per GPU  M(W) = a·N/W + b   — a bytes per parameter of sharded state (fp32 weights, grads and AdamW
  moments are 16; AdamW's multi-tensor step adds temporaries), b the unsharded remainder (activations of one
  micro-batch with checkpointing, the gathered bf16 layers, the head chunk, communication buffers);
- update time     t(W) = α/W + β      — α the data-parallel work of the fixed global batch, β what does not
  shrink with more GPUs (exposed all-gather / reduce-scatter latency, the optimizer's fixed cost, launches);
- full GEAR iteration: rollout r(W) = ρ/W + κ (decoding is launch-bound: κ dominates), signals and update ∝ 1/W
  fitted the same way.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

GIB = 2**30


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares y = p·x + q."""
    p, q = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(p), float(q)


def main(d: Path) -> None:
    upd = [json.loads(p.read_text()) for p in sorted(d.glob("upd_*.json"))]
    gear = sorted((json.loads(p.read_text()) for p in d.glob("gear_*.json")), key=lambda r: r["devices"])
    card = upd[0]["device"]
    print(f"## Update phase (FSDP2, measured on {card} ×1/2/4 of one host; 8 GPUs predicted)\n")
    print(
        "| shape | GPUs | update s | tokens/s | tokens/s/GPU | MFU | peak GiB / GPU | scaling vs 1 GPU | efficiency |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    notes = []
    for shape in sorted({r["shape"] for r in upd}):
        rows = sorted((r for r in upd if r["shape"] == shape), key=lambda r: r["devices"])
        n, tokens = rows[0]["params"], rows[0]["sequences"] * rows[0]["seq_len"]
        a, b = fit([n / r["devices"] / GIB for r in rows], [r["peak_mem_gib_rank0"] for r in rows])
        alpha, beta = fit([1 / r["devices"] for r in rows], [r["update_s_median"] for r in rows])
        base = next((r for r in rows if r["devices"] == 1), None)
        # with no 1-GPU point, the reference is the model's 1-GPU time (α + β) — marked as predicted
        t1 = base["update_s_median"] if base else alpha + beta
        mfu_per_s = rows[0]["mfu"] * rows[0]["update_s_median"] * rows[0]["devices"]  # MFU·t·W is constant
        for w in sorted({r["devices"] for r in rows} | {1, 8}):
            r = next((r for r in rows if r["devices"] == w), None)
            t = r["update_s_median"] if r else alpha / w + beta
            mem = r["peak_mem_gib_rank0"] if r else a * n / w / GIB + b
            fits = "" if r or mem < 140 else " (does not fit a 141 GB card)"
            mark = "" if r else "*"
            print(f"| {shape} | {w}{mark} | {t:.2f}{mark} | {tokens / t:,.0f}{mark} | {tokens / t / w:,.0f}{mark} | "
                  f"{mfu_per_s / (t * w):.1%}{mark} | {mem:.1f}{mark}{fits} | "
                  f"{t1 / t:.2f}×{mark if r is None or base is None else ''} | "
                  f"{t1 / t / w:.0%}{mark if r is None or base is None else ''} |")
        notes.append(f"{shape}: memory fit a = {a:.1f} B/param, b = {b:.1f} GiB; time fit α = {alpha:.2f} s, "
                     f"β = {beta:.2f} s ({len(rows)} measured points).")
    print("\n" + "\n".join(f"- {n}" for n in notes) + "\n")
    if gear:
        print(f"## Full GRPO iteration with the GEAR assigner (qwen3-4b shape, {card})\n")
        print("| GPUs | s / iteration | rollout s | signals + credit s | update s | tokens/s | peak GiB / GPU |")
        print("|---|---|---|---|---|---|---|")
        fits = {k: fit([1 / r["devices"] for r in gear], [r[k] for r in gear])
                for k in ("rollout_s", "signals_credit_s", "update_s")}
        mem = fit([1 / r["devices"] for r in gear], [r["peak_mem_gib_rank0"] for r in gear])
        tok = gear[0]["tokens_per_s"] * gear[0]["s_per_iter"]
        for w in sorted({r["devices"] for r in gear} | {8}):
            r = next((r for r in gear if r["devices"] == w), None)
            if r:
                print(f"| {w} | {r['s_per_iter']:.2f} | {r['rollout_s']:.2f} | {r['signals_credit_s']:.2f} | "
                      f"{r['update_s']:.2f} | "
                      f"{r['tokens_per_s']:,} | {r['peak_mem_gib_rank0']:.1f} |")
            else:
                ph = {k: p / w + q for k, (p, q) in fits.items()}
                s = sum(ph.values())
                print(f"| {w}* | {s:.2f}* | {ph['rollout_s']:.2f}* | {ph['signals_credit_s']:.2f}* | "
                      f"{ph['update_s']:.2f}* | "
                      f"{tok / s:,.0f}* | {mem[0] / w + mem[1]:.1f}* |")
        print("\n\\* predicted by the fitted model, not measured.")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
