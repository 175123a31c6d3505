"""Do processes that share a GPU sample the same tokens from the same weights and seeds? (A comparison runs three
children per card; a paired design needs them to.)

    python experiments/gpu/concurrent_decode_check.py --out concurrent.json [--per-gpu 3] [--rows 128] [--new 256]

For each mode, 3 processes per visible GPU start at once, each with an Inductor cache of its own, build the
benchmark's 0.6B-shape bf16 model (random weights, the same in every process), and sample ``--rows`` rows of
``--new`` tokens twice with the compiled fast decoder (seed 0, temperature 1): the first call compiles and captures,
the second is timed. Modes:
  timed          TORCHINDUCTOR_DETERMINISTIC=0: Inductor times candidate reduction kernels and keeps the fastest
                 (the behaviour before gearlab turned its deterministic mode on)
  deterministic  gearlab's default: Inductor's deterministic mode (no on-device timing of numerics-changing choices)
The JSON gives each process's token digest and ms per decode step; a mode passes when every process (and both calls
of each) gave the same digest.
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

ROOT = Path(__file__).resolve().parents[2]


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
    gen = FastDecoder(tok, batch_size=rows, compile=True)
    sp = SamplingParams(max_new_tokens=new)
    digests, secs = [], []
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(2):
        sync()
        t = time.perf_counter()
        resp, rmask, _ = gen.sample(model, ids, mask, sp, seed=0)
        sync()
        secs.append(time.perf_counter() - t)
        digests.append(hashlib.sha256((resp * rmask).cpu().numpy().tobytes()).hexdigest()[:16])
    Path(out).write_text(json.dumps({
        "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"), "digests": digests,
        "ms_per_step_second_call": round(1000 * secs[1] / gen.stats()["fast/steps"], 3)}))


def run_mode(mode: str, n_gpu: int, per_gpu: int, rows: int, new: int, work: Path) -> dict:
    procs = []
    for i in range(max(1, n_gpu) * per_gpu):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(i % max(1, n_gpu)), MODEL_DIR=str(work / "model"),
                   TORCHINDUCTOR_CACHE_DIR=str(work / f"inductor_{mode}_{i}"))
        env.pop("TORCHINDUCTOR_DETERMINISTIC", None)
        if mode == "timed":
            env["TORCHINDUCTOR_DETERMINISTIC"] = "0"
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
    ap.add_argument("--modes", default="timed,deterministic")
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
