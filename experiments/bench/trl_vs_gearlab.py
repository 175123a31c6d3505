"""One full GRPO iteration, TRL's GRPOTrainer vs gearlab, same model, batch and card, in one run.

    python experiments/bench/trl_vs_gearlab.py --out result.json       # a GPU; TRL + datasets installed

Setting (issue 6's orientation numbers for TRL 1.16): a random-weight model with the Qwen3-0.6B shape
(bf16, vocab 151,936 — a word-level tokenizer with that many entries stands in for Qwen's), 16 prompts × 8
completions, 64-token prompts, 256 new tokens (forced in TRL with ``min_new_tokens``; a random model over
151,936 tokens almost never samples the end token, so gearlab's completions are full length too), HF
``generate`` rollouts in both, gradient checkpointing on, micro-batches of 8, one optimizer step per
iteration (TRL: per-device batch 8 × 16 accumulation steps; gearlab: micro_batch_size 8, one mini-batch).
Reported: seconds per iteration (median of iterations 2..n) and, for gearlab, the rollout / update split.

``--variants`` picks the runs (all in one process, same card): ``gearlab`` (eager HF decoding, dynamic KV
cache), ``gearlab_static`` (``rollout.static_cache=true``: a static KV cache that transformers compiles),
``gearlab_static_compiled`` (the same plus ``trainer.compile=true``: compiled decoder layers and log-prob
head for the training forwards), ``trl`` (TRL's defaults) and ``trl_static`` (TRL with
``cache_implementation="static"`` plus its generation config's ``disable_compile`` switched off after
construction — not a TRL option, the tuning described in docs/hardware.md#trl-decoding-tuning). Iteration 1 (compilation) is excluded by the median.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
V, PROMPTS, G, PROMPT_LEN, NEW = 151_936, 16, 8, 64, 256


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
        def _log_iteration(self, rb, seq_adv, credit_metrics, upd):
            t = {k: upd[k] for k in ("time_rollout_s", "time_signals_credit_s", "time_update_s")}
            t["response_len"] = float(rb.response_mask.sum(-1).float().mean())
            t["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            times.append(t)

    return Timed


def build_model_dir(d: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, max_position_embeddings=4096,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def prompt_text(i: int) -> str:
    g = torch.Generator().manual_seed(i)
    return " ".join(f"w{int(x)}" for x in torch.randint(10, 50_000, (PROMPT_LEN - 5,), generator=g))


def run_trl(model_dir: Path, iters: int, out: Path, static: bool = False) -> dict:
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

    args = GRPOConfig(output_dir=str(out / "trl"), per_device_train_batch_size=8, gradient_accumulation_steps=16,
                      num_generations=G, max_completion_length=NEW, generation_kwargs={"min_new_tokens": NEW},
                      bf16=True, gradient_checkpointing=True, max_steps=iters, logging_steps=1, report_to="none",
                      save_strategy="no", beta=0.0, learning_rate=1e-6, temperature=1.0, top_k=0, top_p=1.0,
                      model_init_kwargs={"dtype": torch.bfloat16},  # bf16 parameters, as gearlab's run here
                      **({"cache_implementation": "static"} if static else {}))
    reward = lambda completions, **kw: [float(torch.rand(())) for _ in completions]  # noqa: E731
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=args, train_dataset=ds)
    if static:
        trainer.generation_config.disable_compile = False  # TRL sets True; the static cache then runs compiled
    trainer.add_callback(Timer())
    trainer.train()
    return {"s_per_iter_all": [round(t, 2) for t in times], "s_per_iter": round(statistics.median(times[1:]), 2)}


def run_gearlab(model_dir: Path, iters: int, static: bool = False, compiled: bool = False) -> dict:
    import lightning as L
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gearlab.config import load_config
    from gearlab.credit import build
    from gearlab.trainer.data import PromptDataModule
    from gearlab.trainer.module import GRPOModule

    # the weights are bf16 themselves; Lightning's precision stays 32-true (its bf16-true plugin would try to
    # cast the batch of prompt objects)
    cfg = load_config(["trainer.accelerator=gpu", "trainer.precision=32-true", "model.dtype=bfloat16",
                       f"rollout.prompts_per_step={PROMPTS}", f"rollout.group_size={G}", f"rollout.max_new_tokens={NEW}",
                       "rollout.batch_size=128", "algorithm.micro_batch_size=8", "trainer.activation_checkpointing=true",
                       "optim.lr=1e-6", "signals.chunk_size=1024", f"trainer.max_steps={iters}",
                       f"rollout.static_cache={static}", f"trainer.compile={compiled}"])
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    task = bench_task()
    times: list[dict] = []
    module = timed_module(GRPOModule, times)(cfg, model, tok, task, build("grpo"))
    dm = PromptDataModule(task, prompts_per_step=PROMPTS, num_steps=iters, seed=0, pool_size=PROMPTS * iters)
    L.Trainer(accelerator="gpu", devices=1, precision="32-true", max_epochs=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0).fit(module, datamodule=dm)
    tot = [sum(v for k, v in t.items() if k.startswith("time_")) for t in times]
    med = lambda k: round(statistics.median([t[k] for t in times[1:]]), 2)  # noqa: E731
    return {"s_per_iter_all": [round(t, 2) for t in tot], "s_per_iter": round(statistics.median(tot[1:]), 2),
            "rollout_s": med("time_rollout_s"), "update_s": med("time_update_s"),
            "response_len_mean": round(statistics.mean(t["response_len"] for t in times), 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--variants", default="gearlab,gearlab_static,trl,trl_static")
    ap.add_argument("--out", default="trl_vs_gearlab.json")
    a = ap.parse_args()
    work = Path(os.environ.get("BENCH_WORK", "/tmp")) / "gearlab_bench_model"
    model_dir = build_model_dir(work)
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "setting":
           f"Qwen3-0.6B shape, random bf16 weights, {PROMPTS} prompts x {G}, {PROMPT_LEN}-token prompts, {NEW} new tokens"}
    for v in a.variants.split(","):
        if v.startswith("gearlab"):
            res[v] = run_gearlab(model_dir, a.iters, static="_static" in v, compiled=v.endswith("_compiled"))
        else:
            import trl

            res["trl_version"] = trl.__version__
            res[v] = run_trl(model_dir, a.iters, work / v, static=v.endswith("_static"))
        print(json.dumps(res), flush=True)
    for g in ("gearlab", "gearlab_static", "gearlab_static_compiled"):
        for t in ("trl", "trl_static"):
            if g in res and t in res:
                res[f"speedup_{g}_over_{t}"] = round(res[t]["s_per_iter"] / res[g]["s_per_iter"], 2)
    print(json.dumps(res), flush=True)
    Path(a.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
