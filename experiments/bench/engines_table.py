"""The Markdown table of ``engines_gpus.sh``'s results: one row per variant JSON in the folders given, the card named.

    python experiments/bench/engines_table.py experiments/bench/results/engines_h200x2
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def table(dirs: list[Path]) -> str:
    rows = [json.loads(p.read_text()) | {"name": p.stem} for d in dirs for p in sorted(d.glob("*.json"))]
    rows = [r for r in rows if "s_per_iter" in r]  # the folder also holds the launch and world-size records
    cards = sorted({r["device"] for r in rows})
    out = [f"Card: {', '.join(cards)}. Each phase: the median of the timed iterations (those after the variant's "
           "warm-up); peak = rank 0's max allocated.", "",
           "| variant | shape | GPUs | engine | overrides | timed iterations | s / iteration | rollout s | "
           "signals + credit s | update s | decode ms / step | graphs captured / rollout | capture s | "
           "replica refresh s | peak GiB / GPU |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["shape"], r["devices"], r["name"])):
        e = r.get("engine_stats", {})
        engine = r["engine"] + (f" ({r['sharded_weights']})" if r["engine"] == "fast" and r["devices"] > 1 else "")
        engine += f" TP{r['vllm_tp']}" if r["engine"] == "vllm" and r.get("vllm_tp", 1) > 1 else ""
        cell = lambda k: f"{e[k]:.2f}" if k in e else "–"  # noqa: E731
        overrides = " ".join(f"`{o}`" for o in r.get("overrides", [])) or "–"
        warm, n = r.get("warmup_iters", 1), len(r.get("s_per_iter_all", []))
        timed = f"{warm + 1}–{n}" if n > warm + 1 else (f"{n}" if n else "–")
        out.append(f"| {r['name']} | {r['shape']} | {r['devices']} | {engine} | {overrides} | {timed} | "
                   f"{r['s_per_iter']:.2f} | "
                   f"{r['rollout_s']:.2f} | {r['signals_credit_s']:.2f} | {r['update_s']:.2f} | "
                   f"{cell('fast/ms_per_step')} | {cell('fast/graphs_captured')} | {cell('fast/capture_s')} | "
                   f"{cell('fast/replica_refresh_s')} | {r['peak_mem_gib_rank0']:.1f} |")
    return "\n".join(out)


if __name__ == "__main__":
    print(table([Path(a) for a in sys.argv[1:]]))
