"""Rollout decoding alone: HF ``generate`` vs gearlab's fast decode path, each variant in its own process.

    python experiments/bench/fast_decode.py --size tiny --out results/fast_decode_cpu.json     # CPU or GPU

Workload: the arithmetic task's prompts (16 × 8 = 128 rows, chat-formatted, left-padded), ``--new`` tokens sampled at
T = 1 with the run's real stop tokens, random weights of gearlab's embedded Qwen3 sizes (``tiny`` 1.24M parameters,
``small`` 25.3M). Variants: ``hf`` (``generate``, dynamic KV cache), ``hf_static`` (``generate`` with a static
cache, which transformers compiles on GPUs only), ``fast`` (``rollout.engine=fast``: CUDA graphs on GPUs),
``fast_compiled`` (the same, with ``rollout.fast.compile=true``). Each: one warm-up call, then the median of
``--repeats`` timed calls; reported as seconds per call, ms per decode step and generated tokens per second.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
VARIANTS = ("hf", "hf_static", "fast", "fast_compiled")


def run_one(variant: str, size: str, new: int, repeats: int) -> dict:
    from gearlab.models.tiny import MODEL_SIZES, build_tiny_model, build_tokenizer
    from gearlab.rollout.base import SamplingParams
    from gearlab.rollout.fast import FastDecoder
    from gearlab.rollout.hf import HFRolloutEngine
    from gearlab.tasks.registry import get_task

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = build_tokenizer()
    model = build_tiny_model(tok, seed=0, **MODEL_SIZES[size]).to(dev).eval()
    task = get_task("arith")
    gen = FastDecoder(tok, batch_size=128, compile=variant == "fast_compiled") if variant.startswith("fast") else None
    eng = HFRolloutEngine(tok, task, batch_size=128, generator=gen, static_cache=variant == "hf_static")
    ids, mask = eng.encode_prompts(task.problems("train", 16, seed=0))
    ids, mask = ids.repeat_interleave(8, 0), mask.repeat_interleave(8, 0)
    sp = SamplingParams(max_new_tokens=new)
    times, steps, tokens = [], [], []
    for i in range(repeats + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        resp, rmask, _ = eng.sample_with_logprobs(model, ids, mask, sp, seed=i)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i:  # call 0 warms up (compilation, graph capture)
            times.append(time.perf_counter() - t)
            steps.append(resp.shape[1])
            tokens.append(int(rmask.sum()))
    s = statistics.median(times)
    return {"s_per_call": round(s, 4), "ms_per_step": round(1000 * s / statistics.median(steps), 3),
            "tokens_per_s": round(statistics.median(tokens) / s, 1), "steps": statistics.median(steps),
            "calls_s": [round(t, 4) for t in times]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="fast_decode.json")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        Path(a.out).write_text(json.dumps(run_one(a.one, a.size, a.new, a.repeats)))
        return
    cuda = torch.cuda.is_available()
    res = {"device": torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} cores, {torch.get_num_threads()} threads)", "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "size": a.size, "rows": 128, "max_new_tokens": a.new}
    for v in a.variants.split(","):
        part = Path(a.out).with_suffix(f".{v}.part")
        rc = subprocess.run([sys.executable, __file__, "--one", v, "--size", a.size, "--new", str(a.new),
                             "--repeats", str(a.repeats), "--out", str(part)]).returncode
        res[v] = json.loads(part.read_text()) if rc == 0 and part.exists() else {"error": f"exit code {rc}"}
        part.unlink(missing_ok=True)
        print(json.dumps({v: res[v]}), flush=True)
    base = res.get("hf", {}).get("s_per_call")
    if base:
        res["speedup_over_hf"] = {
            v: round(base / res[v]["s_per_call"], 2) for v in VARIANTS if "s_per_call" in res.get(v, {})
        }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
