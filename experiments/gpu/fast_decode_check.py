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
                     HF static-cache compiled generate, fast eager, fast + graphs, fast + compile + graphs (also
                     fused, with flex, split and cuDNN attention, the fused draw, all three; each after a warm-up
                     call), engine-vs-trainer mismatch
                     (mean |Δ|), greedy agreement with HF
  flex_*             rollout.fast.attention=flex (compiled flex_attention at decode steps; eager on the CPU), small
                     fp32 model: greedy = HF generate (flex_greedy_fp32); sampled tokens = the SDPA path's and
                     log-probs within 1e-5 (flex_vs_sdpa); after an in-place optimizer step (flex_after_step)
  split_*            the same three checks with rollout.fast.attention=split (gearlab's split-K Triton kernel)
  fused_sampler      rollout.fast.sampler=fused, small fp32 model: the torch sampler's tokens, log-probs within 1e-5
  flex_long          the 0.6B shape in bf16 at long caches (64-token prompts, 1,024 new tokens) and small batches:
                     ms per decode step, SDPA vs flex vs split (graphs), each one's engine-vs-trainer mismatch, and
                     the flex kernels an uncaptured step launches (Inductor's flex decoding kernel or not)

``--only check_split,check_flex_long`` runs just those checks (names: ``CHECKS``).
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


def _check_attention(res: dict, attention: str) -> None:
    """rollout.fast.attention=<attention> on the small fp32 model (CUDA graphs; compiled flex_attention or the
    split-K Triton kernel on a GPU): greedy = HF generate, sampled tokens = the SDPA path's, after a step."""
    tok, model, eng, ids, mask = small_setup()
    greedy = SamplingParams(max_new_tokens=48, greedy=True)
    ref, ref_mask = eng.sample(model, ids, mask, greedy, seed=0)
    fast = FastDecoder(tok, batch_size=128, attention=attention)
    out, omask, _ = fast.sample(model, ids, mask, greedy, seed=0)
    res[f"{attention}_greedy_fp32"] = {"pass": bool(torch.equal(out, ref) and torch.equal(omask, ref_mask)),
                                       "rows_equal": int((out == ref).all(1).sum()) if out.shape == ref.shape else 0}
    sp = SamplingParams(max_new_tokens=48)
    a = fast.sample(model, ids, mask, sp, seed=5)
    b = FastDecoder(tok, batch_size=128).sample(model, ids, mask, sp, seed=5)
    same = a[0].shape == b[0].shape and torch.equal(a[0], b[0])
    diff = float((a[2] - b[2])[b[1]].abs().max()) if same else float("nan")
    res[f"{attention}_vs_sdpa"] = {"pass": bool(same and diff < 1e-5), "max_lp_diff": diff,
                                   "graphs_captured": fast.stats()["fast/graphs_captured"]}
    res[f"{attention}_after_step"] = step_then_decode(fast, model, ids, mask, sp, a)


def check_flex(res: dict) -> None:
    _check_attention(res, "flex")


def check_split(res: dict) -> None:
    _check_attention(res, "split")


def check_fused_sampler(res: dict) -> None:
    """rollout.fast.sampler=fused (the one-pass Triton draw on a GPU) on the small fp32 model: the torch sampler's
    tokens and log-probs within 1e-5, at temperatures 1 and 0.7."""
    tok, model, eng, ids, mask = small_setup()
    out = {}
    for t in (1.0, 0.7):
        sp = SamplingParams(max_new_tokens=48, temperature=t)
        a = FastDecoder(tok, batch_size=128, sampler="fused").sample(model, ids, mask, sp, seed=3)
        b = FastDecoder(tok, batch_size=128).sample(model, ids, mask, sp, seed=3)
        same = a[0].shape == b[0].shape and torch.equal(a[0], b[0])
        diff = float((a[2] - b[2])[b[1]].abs().max()) if same else float("nan")
        out[f"T{t}"] = {"pass": bool(same and diff < 1e-5), "max_lp_diff": diff,
                        "rows_equal": int((a[0] == b[0]).all(1).sum()) if a[0].shape == b[0].shape else 0}
    res["fused_sampler"] = out


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


def bench_setup():
    """The benchmark's 0.6B-shape bf16 model (random weights), tokenizer, task, HF engine and its 16 × 8 prompts."""
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
    return bench, tok, model, task, eng, ids, mask


def timed(fn):
    """(seconds of the second call, its result): the first is the warm-up (compilation, graph capture)."""
    fn()
    sync()
    t = time.perf_counter()
    r = fn()
    sync()
    return time.perf_counter() - t, r


def check_06b(res: dict) -> None:
    from gearlab.rollout.hf import HFRolloutEngine

    bench, tok, model, task, eng, ids, mask = bench_setup()
    sp = SamplingParams(max_new_tokens=bench.NEW)
    out = {"rows": len(ids), "new_tokens": bench.NEW}
    if DEV.type == "cuda":
        static = HFRolloutEngine(tok, task, batch_size=len(ids), static_cache=True)
        s, _ = timed(lambda: static.sample(model, ids, mask, sp, seed=0))
        out["hf_static_compiled_ms_per_step"] = round(1000 * s / bench.NEW, 2)
    # compile set explicitly: its default (None) is on with CUDA
    for name, kw in (("fast_eager", dict(cuda_graphs="off", compile=False)), ("fast_graphs", dict(compile=False)),
                     ("fast_compiled_graphs", dict(compile=True)),
                     ("fast_compiled_graphs_fused", dict(compile=True, fused=True)),
                     ("fast_compiled_graphs_flex", dict(compile=True, attention="flex")),
                     ("fast_compiled_graphs_split", dict(compile=True, attention="split")),
                     ("fast_compiled_graphs_cudnn", dict(compile=True, attention="sdpa_auto")),
                     ("fast_compiled_graphs_fused_sampler", dict(compile=True, sampler="fused")),
                     ("fast_compiled_graphs_all", dict(compile=True, attention="split", fused=True, sampler="fused"))):
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


def check_flex_long(res: dict) -> None:
    """Decode steps at long caches and small batches, where a split-K decode kernel should pay: SDPA vs flex."""
    from torch.profiler import ProfilerActivity, profile

    bench, tok, model, task, eng, ids, mask = bench_setup()
    new = 64 if SMOKE else 1024
    out = {"new_tokens": new, "prompt_tokens": ids.shape[1]}
    for rows in (8, 32):
        sp = SamplingParams(max_new_tokens=new)
        for attention in ("sdpa", "flex", "split"):
            gen = FastDecoder(tok, batch_size=rows, attention=attention)
            gen.stop_ids = [-1]  # every row runs the whole length (a random model rarely samples the end token)
            s, (resp, rmask, lp) = timed(lambda: gen.sample(model, ids[:rows], mask[:rows], sp, seed=0))
            with torch.no_grad():
                ref = trainer_logprobs(model, ids[:rows], mask[:rows], resp, rmask).float().cpu()
            out[f"{attention}_b{rows}_ms_per_step"] = round(1000 * s / gen.stats()["fast/steps"], 3)
            out[f"{attention}_b{rows}_engine_lp_diff_abs_mean"] = round(float((ref - lp)[rmask].abs().mean()), 5)
    gen = FastDecoder(tok, batch_size=8, cuda_graphs="off", attention="flex")  # uncaptured: the profiler sees kernels
    short = SamplingParams(max_new_tokens=8)
    gen.sample(model, ids[:8], mask[:8], short, seed=0)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV.type == "cuda" else [])) as prof:
        gen.sample(model, ids[:8], mask[:8], short, seed=0)
        sync()
    out["flex_kernels"] = sorted({e.key[:100] for e in prof.key_averages()
                                  if "flex" in e.key.lower() or "triton_tem" in e.key})[:10]
    out["inductor_flex_decoding_choices"] = FLEX_DECODING_LOG[:10]  # Inductor's own "Use flex decoding …" lines
    res["flex_long"] = out


FLEX_DECODING_LOG: list[str] = []


def log_flex_decoding_choices() -> None:
    """Record Inductor's decision, at each compile of flex_attention on CUDA, whether to use its decode kernel
    (``_use_flex_decoding`` logs it at DEBUG level)."""
    import logging

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            FLEX_DECODING_LOG.append(record.getMessage()[:300])

    log = logging.getLogger("torch._inductor.kernel.flex.flex_decoding")
    log.setLevel(logging.DEBUG)
    log.addHandler(Keep(logging.DEBUG))


CHECKS = {"check_small": check_small, "check_flex": check_flex, "check_split": check_split,
          "check_fused_sampler": check_fused_sampler, "check_06b": check_06b, "check_flex_long": check_flex_long}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fast_decode_check.json")
    ap.add_argument("--skip-0.6b", dest="skip_big", action="store_true", help="only the small model's checks")
    ap.add_argument("--only", default="", help=f"comma-separated checks to run, of {', '.join(CHECKS)}")
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(0) if DEV.type == "cuda" else "cpu", "torch": torch.__version__}
    names = a.only.split(",") if a.only else [n for n in CHECKS if not (a.skip_big and n in ("check_06b",
                                                                                          "check_flex_long"))]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        sys.exit(f"--only: unknown check(s) {', '.join(unknown)} (known: {', '.join(CHECKS)})")
    log_flex_decoding_choices()
    for fn in (CHECKS[n] for n in names):
        try:
            fn(res)
        except Exception as e:  # report and go on: one call should return every check it can
            res[fn.__name__] = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(json.dumps(res), flush=True)
    Path(a.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
