"""Do processes that share a GPU sample the same tokens from the same weights and seeds? (A comparison runs three
children per card; a paired design needs them to.)

    python experiments/gpu/concurrent_decode_check.py --out concurrent.json [--per-gpu 3] [--rows 128] [--new 256]
        [--modes timed,cudnn,sdpa,split]

For each mode, ``--per-gpu`` processes per visible GPU start at once, each with an Inductor cache of its own, load
the benchmark's 0.6B-shape bf16 model (seeded random weights, built once by the parent) and sample ``--rows`` rows of
``--new`` tokens three times with the compiled fast decoder (seed 0, temperature 1): the first call compiles and
captures, the second is timed. Modes:
  timed   TORCHINDUCTOR_DETERMINISTIC=0 and rollout.fast.attention=sdpa_auto (Inductor times candidate reduction
          kernels; SDPA picks its backend, cuDNN on Hopper): the behaviour before either fix
  cudnn   Inductor's deterministic mode, attention=sdpa_auto (gearlab's default on 2026-12-01, before this check)
  sdpa    Inductor's deterministic mode, attention=sdpa (no cuDNN attention): gearlab's default now
  split   Inductor's deterministic mode, attention=split (gearlab's split-K Triton kernel at decode)
Each process also runs one decode-shape attention (rows × 16 query heads over 8 K/V heads, 384 positions, a
boolean mask) 20 times on fixed inputs with each backend alone, and one forward+backward on 32 of the prompts three
times with the default kernels and three times with deterministic algorithms requested, and reports how many
distinct outputs (gradients) each gave.
The JSON gives each process's token digests and ms per decode step; a mode passes when every process (and every
call of each) gave the same digest.

On an H200 (torch 2.11.0+cu130, 2026-12-01; 128 rows × 256 tokens) the first two modes, with 3 processes at once
and with 1 process run twice, gave a different digest in every process and in every process's first and second
call; 64 rows × 64 tokens repeated exactly in one process.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def attention_repeats(dev: Any, rows: int, n: int = 20) -> dict:
    """Distinct outputs of ``n`` runs of one decode-shape attention on fixed inputs, per SDPA backend."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g).to(dev, torch.bfloat16)
               for shape in ((rows, 16, 1, 128), (rows, 8, 384, 128), (rows, 8, 384, 128)))
    mask = torch.ones(rows, 1, 1, 384, dtype=torch.bool, device=dev)
    mask[:, :, :, :40] = False  # left padding
    mask[:, :, :, 300:] = False  # positions not filled yet
    out = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("math", SDPBackend.MATH)):
        digests = set()
        try:
            with sdpa_kernel(backend):
                for _ in range(n):
                    if name == "cudnn":
                        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
                    else:  # the decoder's grouped view: the query heads of one K/V head as its query positions
                        o = F.scaled_dot_product_attention(q.reshape(rows, 8, 2, 128), k, v, attn_mask=mask)
                    digests.add(hashlib.sha256(o.float().cpu().numpy().tobytes()).hexdigest()[:16])
            out[name] = len(digests)
        except RuntimeError as e:  # a backend that refuses these inputs
            out[name] = f"refused: {str(e).splitlines()[0][:120]}"
    return out


def update_repeats(model: Any, ids: Any, mask: Any, n: int = 3) -> dict:
    """Distinct gradient digests of ``n`` forward+backward passes of one loss on a fixed batch (the update's
    attention: SDPA without cuDNN), with PyTorch's default kernels and with deterministic algorithms requested."""
    import torch

    from gearlab.core.sdpa import differentiable_attention

    out = {}
    for name, det in (("default", False), ("deterministic_algorithms", True)):
        torch.use_deterministic_algorithms(det, warn_only=True)
        digests = set()
        for _ in range(n):
            model.zero_grad(set_to_none=True)
            with differentiable_attention():
                logits = model(input_ids=ids, attention_mask=mask).logits
            logits.float().logsumexp(-1).mean().backward()
            g = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
            digests.add(hashlib.sha256(g.cpu().numpy().tobytes()).hexdigest()[:16])
        out[name] = len(digests)
    torch.use_deterministic_algorithms(False)
    model.zero_grad(set_to_none=True)
    return out


def worker(out: str, rows: int, new: int) -> None:
    import torch

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "experiments" / "bench"))
    import trl_vs_gearlab as bench
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gearlab.rollout.base import SamplingParams
    from gearlab.rollout.fast import FastDecoder
    from gearlab.rollout.hf import HFRolloutEngine

    d = Path(os.environ["MODEL_DIR"])  # built once by the parent
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = AutoTokenizer.from_pretrained(d)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).to(dev).eval()
    task = bench.bench_task()
    ids, mask = HFRolloutEngine(tok, task, batch_size=rows).encode_prompts(task.problems("train", rows))
    gen = FastDecoder(tok, batch_size=rows, compile=True, attention=os.environ["ATTENTION"])
    sp = SamplingParams(max_new_tokens=new)
    digests, secs = [], []
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(3):
        sync()
        t = time.perf_counter()
        resp, rmask, _ = gen.sample(model, ids, mask, sp, seed=0)
        sync()
        secs.append(time.perf_counter() - t)
        digests.append(hashlib.sha256((resp * rmask).cpu().numpy().tobytes()).hexdigest()[:16])
    Path(out).write_text(json.dumps({
        "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"), "digests": digests,
        "ms_per_step_second_call": round(1000 * secs[1] / gen.stats()["fast/steps"], 3),
        "attention_distinct_of_20": attention_repeats(dev, rows),
        "update_distinct_of_3": update_repeats(model, ids[:32].to(dev), mask[:32].to(dev))}))


def run_mode(mode: str, n_gpu: int, per_gpu: int, rows: int, new: int, work: Path) -> dict:
    procs = []
    for i in range(max(1, n_gpu) * per_gpu):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(i % max(1, n_gpu)), MODEL_DIR=str(work / "model"),
                   TORCHINDUCTOR_CACHE_DIR=str(work / f"inductor_{mode}_{i}"))
        env.pop("TORCHINDUCTOR_DETERMINISTIC", None)
        if mode == "timed":
            env["TORCHINDUCTOR_DETERMINISTIC"] = "0"
        env["ATTENTION"] = mode if mode in ("sdpa", "split") else "sdpa_auto"
        out = work / f"{mode}_{i}.json"
        procs.append((out, subprocess.Popen([sys.executable, __file__, "--worker", str(out), "--rows", str(rows),
                                             "--new", str(new)], env=env)))
    runs = []
    for out, p in procs:
        rc = p.wait()
        runs.append(json.loads(out.read_text()) if rc == 0 and out.is_file() else {"rc": rc})
    digests = {dg for r in runs for dg in r.get("digests", [])}
    ok = all("digests" in r for r in runs) and len(digests) == 1
    return {"pass": ok, "distinct_digests": len(digests), "processes": runs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="concurrent_decode.json")
    ap.add_argument("--worker", default=None)
    ap.add_argument("--per-gpu", type=int, default=3)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--modes", default="cudnn,sdpa")
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker, a.rows, a.new)
    import torch

    n_gpu = torch.cuda.device_count()  # 0: a CPU smoke run (BENCH_SMOKE=1: the tiny model), one process slot
    work = Path(tempfile.mkdtemp(prefix="gearlab_concurrent_"))
    sys.path.insert(0, str(ROOT / "experiments" / "bench"))
    import trl_vs_gearlab as bench

    bench.build_model_dir(work / "model")  # once, before the workers read it
    res = {"card": torch.cuda.get_device_name(0) if n_gpu else "cpu", "gpus": n_gpu, "per_gpu": a.per_gpu,
           "rows": a.rows, "new_tokens": a.new, "torch": torch.__version__}
    for mode in a.modes.split(","):
        t = time.time()
        res[mode] = run_mode(mode, n_gpu, a.per_gpu, a.rows, a.new, work)
        res[mode]["wall_s"] = round(time.time() - t, 1)
        print(mode, json.dumps({k: v for k, v in res[mode].items() if k != "processes"}), flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
