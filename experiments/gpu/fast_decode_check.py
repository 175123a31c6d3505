"""The fast decode path (rollout.engine=fast) on a GPU: the checks the CPU tests cannot make, and its decode speed.

    python experiments/gpu/fast_decode_check.py --out fast_check.json          # a CUDA GPU
    BENCH_SMOKE=1 python experiments/gpu/fast_decode_check.py --out x.json     # CPU: a small model, no graphs

Checks (each a key of the JSON, with pass/fail and the numbers):
  greedy_fp32        a small fp32 Qwen3 model on the GPU: greedy tokens of the CUDA-graph path equal HF ``generate``'s
  graphs_vs_eager    the same batch decoded with and without CUDA graphs: equal tokens, log-probs within 1e-5
  row_seeds          a row sampled alone equals the same row in a batch of 128 (per-row seeds on the GPU)
  after_step         an in-place optimizer step, then a rollout through the already-captured graphs: the engine's
                     log-probs match the trainer's forward under the NEW weights
  bf16_0.6b          the Qwen3-0.6B shape in bf16, 128 × 64-token prompts, 256 new tokens: ms per decode step for
                     HF static-cache compiled generate, fast eager, fast + graphs, fast + compile + graphs (each
                     after a warm-up call), engine-vs-trainer log-prob mismatch (mean |Δ|), greedy agreement with HF
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gearlab.core.logprobs import response_hidden, token_logprobs  # noqa: E402
from gearlab.rollout.base import SamplingParams  # noqa: E402
from gearlab.rollout.fast import FastDecoder  # noqa: E402

SMOKE = bool(os.environ.get("BENCH_SMOKE"))
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def trainer_logprobs(model, ids, mask, resp, rmask, temperature=1.0):
    """The trainer's log-probs of the sampled tokens [N, T] (differentiable when grad is enabled)."""
    x = torch.cat([ids, resp], 1).to(DEV)
    am = torch.cat([mask.bool(), rmask], 1).long().to(DEV)
    h = response_hidden(model, x, am, ids.shape[1], resp.shape[1])
    return token_logprobs(h, model.get_output_embeddings(), resp.to(DEV), temperature=temperature)[0]


def greedy_agreement(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Agreement of two greedy [N, T] token tensors over their common width: rows identical, mean agreeing prefix."""
    w = min(a.shape[1], b.shape[1])
    same = (a[:, :w] == b[:, :w]).long().cumprod(1).sum(1)
    return {"rows_identical": int((same == w).sum()), "rows": len(a),
            "mean_agreeing_prefix": round(float(same.float().mean()), 1),
            "tokens": w}


def small_setup():
    from gearlab.models.tiny import build_tiny_model, build_tokenizer
    from gearlab.rollout.hf import HFRolloutEngine
    from gearlab.tasks.registry import get_task

    tok = build_tokenizer()
    model = build_tiny_model(tok, seed=0).to(DEV).eval()
    task = get_task("arith")
    eng = HFRolloutEngine(tok, task, batch_size=128)
    ids, mask = eng.encode_prompts(task.problems("train", 32, seed=2))
    return tok, model, eng, ids.repeat(4, 1), mask.repeat(4, 1)  # 128 rows


def check_small(res: dict) -> None:
    tok, model, eng, ids, mask = small_setup()
    greedy = SamplingParams(max_new_tokens=48, greedy=True)
    ref, ref_mask = eng.sample(model, ids, mask, greedy, seed=0)
    fast = FastDecoder(tok, batch_size=128)
    out, omask, _ = fast.sample(model, ids, mask, greedy, seed=0)
    res["greedy_fp32"] = {"pass": bool(torch.equal(out, ref) and torch.equal(omask, ref_mask)),
                          "rows_equal": int((out == ref).all(1).sum()) if out.shape == ref.shape else 0,
                          "rows": len(ids),
                          "graphs_captured": fast.stats()["fast/graphs_captured"]}
    sp = SamplingParams(max_new_tokens=48)
    a = fast.sample(model, ids, mask, sp, seed=5)
    b = FastDecoder(tok, batch_size=128, cuda_graphs="off").sample(model, ids, mask, sp, seed=5)
    res["graphs_vs_eager"] = {"pass": bool(torch.equal(a[0], b[0]) and (a[2] - b[2]).abs().max() < 1e-5),
                              "max_lp_diff": float((a[2] - b[2]).abs().max())}
    alone = FastDecoder(tok, batch_size=128).sample(model, ids[7:8], mask[7:8], sp, seed=5 + 7)
    n = alone[0].shape[1]
    res["row_seeds"] = {"pass": bool(torch.equal(alone[0], a[0][7:8, :n]))}
    res["after_step"] = step_then_decode(fast, model, ids, mask, sp, a)
    check_small_fused(res, tok, model, eng, ids, mask)


def check_small_fused(res: dict, tok, model, eng, ids, mask) -> None:
    """rollout.fast.fused_projections: greedy = HF generate, and after an in-place optimizer step the graphs
    captured before it decode with the refreshed copies (log-probs = the trainer's)."""
    greedy = SamplingParams(max_new_tokens=48, greedy=True)
    ref, ref_mask = eng.sample(model, ids, mask, greedy, seed=0)
    fast = FastDecoder(tok, batch_size=128, fused=True)
    out, omask, _ = fast.sample(model, ids, mask, greedy, seed=0)
    res["fused_greedy_fp32"] = {"pass": bool(torch.equal(out, ref) and torch.equal(omask, ref_mask)),
                                "rows_equal": int((out == ref).all(1).sum()) if out.shape == ref.shape else 0}
    sp = SamplingParams(max_new_tokens=48)
    a = fast.sample(model, ids, mask, sp, seed=5)
    res["fused_after_step"] = step_then_decode(fast, model, ids, mask, sp, a)


def step_then_decode(fast, model, ids, mask, sp, a) -> dict:
    """One in-place optimizer step on the rollout ``a``, then a rollout through the graphs captured before it: its
    log-probs against the trainer's."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = -(trainer_logprobs(model, ids[:8], mask[:8], a[0][:8], a[1][:8]) * a[1][:8].to(DEV)).sum() / a[1][:8].sum()
    loss.backward()
    opt.step()
    model.eval()
    c = fast.sample(model, ids, mask, sp, seed=9)
    with torch.no_grad():
        ref_lp = trainer_logprobs(model, ids, mask, c[0], c[1]).float().cpu()
    diff = float((ref_lp - c[2])[c[1]].abs().max())
    return {"pass": diff < 1e-4, "max_lp_diff": diff, "graphs_captured": fast.stats()["fast/graphs_captured"]}


def check_06b(res: dict) -> None:
    sys.path.insert(0, str(ROOT / "experiments" / "bench"))
    import trl_vs_gearlab as bench  # the benchmark's model, tokenizer and prompts
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gearlab.rollout.hf import HFRolloutEngine

    d = bench.build_model_dir(Path(os.environ.get("BENCH_WORK", "/tmp")) / "gearlab_fast_check_model")
    tok = AutoTokenizer.from_pretrained(d)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).to(DEV).eval()
    task = bench.bench_task()
    eng = HFRolloutEngine(tok, task, batch_size=bench.PROMPTS * bench.G)
    ids, mask = eng.encode_prompts(task.problems("train", bench.PROMPTS))
    ids, mask = ids.repeat_interleave(bench.G, 0), mask.repeat_interleave(bench.G, 0)
    sp = SamplingParams(max_new_tokens=bench.NEW)
    out = {"rows": len(ids), "new_tokens": bench.NEW}

    def timed(fn):
        fn()  # warm-up: compilation, graph capture
        sync()
        t = time.perf_counter()
        r = fn()
        sync()
        return time.perf_counter() - t, r

    if DEV.type == "cuda":
        static = HFRolloutEngine(tok, task, batch_size=len(ids), static_cache=True)
        s, _ = timed(lambda: static.sample(model, ids, mask, sp, seed=0))
        out["hf_static_compiled_ms_per_step"] = round(1000 * s / bench.NEW, 2)
    # compile set explicitly: its default (None) is on with CUDA
    for name, kw in (("fast_eager", dict(cuda_graphs="off", compile=False)), ("fast_graphs", dict(compile=False)),
                     ("fast_compiled_graphs", dict(compile=True)),
                     ("fast_compiled_graphs_fused", dict(compile=True, fused=True))):
        if name != "fast_eager" and DEV.type != "cuda":
            continue
        gen = FastDecoder(tok, batch_size=len(ids), **kw)
        try:
            s, (resp, rmask, lp) = timed(lambda: gen.sample(model, ids, mask, sp, seed=0))
        except Exception as e:  # one variant failing leaves the others' numbers
            out[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        out[f"{name}_ms_per_step"] = round(1000 * s / gen.stats()["fast/steps"], 2)
        with torch.no_grad():
            ref = trainer_logprobs(model, ids, mask, resp, rmask).float().cpu()
        out[f"{name}_engine_lp_diff_abs_mean"] = round(float((ref - lp)[rmask].abs().mean()), 5)
    g = SamplingParams(max_new_tokens=64, greedy=True)
    a, _ = eng.sample(model, ids[:16], mask[:16], g, seed=0)
    b, _, _ = FastDecoder(tok, batch_size=16).sample(model, ids[:16], mask[:16], g, seed=0)
    out["greedy_vs_hf_bf16"] = greedy_agreement(a, b)
    res["bf16_0.6b"] = out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fast_decode_check.json")
    ap.add_argument("--skip-0.6b", dest="skip_big", action="store_true")
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(0) if DEV.type == "cuda" else "cpu", "torch": torch.__version__}
    for fn in (check_small,) + (() if a.skip_big else (check_06b,)):
        try:
            fn(res)
        except Exception as e:  # report and go on: one call should return every check it can
            res[fn.__name__] = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(json.dumps(res), flush=True)
    Path(a.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
