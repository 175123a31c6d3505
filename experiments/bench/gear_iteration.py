"""Full GRPO iterations with the GEAR assigner under FSDP2 on N GPUs: rollout (``--engine``: auto = what
``gearlab train`` picks, i.e. the fast decoder on GPUs; hf; fast; vllm), signals
(the live teacher forward = the sharded policy on the answer-conditioned context, the full-vocabulary
KL), credit, update — the real ``GRPOModule`` path that ``gearlab train`` runs.

    python experiments/bench/gear_iteration.py --shape qwen3-4b --devices 4 --engine auto --out r.json

Random-weight Qwen3 shapes (vocab 151,936: the end token is almost never sampled, so every completion
is ``--new`` tokens long), fp32 master weights with bf16 compute (the recipes' setting), 16 prompts × G=8
× (64 prompt + ``--new`` new tokens), micro-batches of 8, activation checkpointing, one optimizer step per
iteration. The prompt batch is global: each rank rolls out prompts/devices prompts. Reports the median of
iterations warmup+1..n per phase (``--warmup``, default 1: iteration 1 compiles and captures graphs), every
iteration's phases, and rank 0's peak memory.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trl_vs_gearlab import G, PROMPTS, V, bench_task, build_tokenizer, timed_module  # noqa: E402
from update_mfu import SHAPES  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b", choices=sorted(SHAPES))
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--assigner", default="gear")
    ap.add_argument("--strategy", default="fsdp2", choices=["fsdp2", "fsdp1", "ddp"])
    ap.add_argument("--new", type=int, default=256, help="new tokens per completion")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1,
                    help="leading iterations left out of the medians (compile and graph capture happen there)")
    ap.add_argument("--engine", default="auto", choices=["auto", "hf", "fast", "vllm"])
    ap.add_argument("--sharded-weights", default="gather", choices=["gather", "replica"],
                    help="fast decoder on a sharded policy: rollout.fast.sharded_weights")
    ap.add_argument("--tp", type=int, default=1, help="vllm: rollout.vllm.tensor_parallel_size")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a further config override, after the workload's (repeatable)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    import lightning as L
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gearlab.parallel import distributed
    from gearlab.config import load_config
    from gearlab.credit import build
    from gearlab.trainer.data import PromptDataModule
    from gearlab.trainer.module import GRPOModule

    gpu = torch.cuda.is_available()
    cfg = load_config([f"trainer.devices={a.devices}", f"trainer.strategy={a.strategy}",
                       f"trainer.accelerator={'gpu' if gpu else 'cpu'}",
                       f"trainer.precision={'bf16-mixed' if gpu else '32-true'}", "model.dtype=float32",
                       f"rollout.prompts_per_step={PROMPTS}", f"rollout.group_size={G}", f"rollout.engine={a.engine}",
                       f"rollout.fast.sharded_weights={a.sharded_weights}",
                       f"rollout.vllm.tensor_parallel_size={a.tp}",
                       f"rollout.max_new_tokens={a.new}",
                       "rollout.batch_size=128", "algorithm.micro_batch_size=8",
                       "trainer.activation_checkpointing=true",
                       "optim.lr=1e-6", "signals.chunk_size=1024", f"trainer.max_steps={a.iters}",
                       f"assigner={a.assigner}", *a.set])
    tok = build_tokenizer()
    torch.manual_seed(0)
    mcfg = Qwen3Config(vocab_size=V, max_position_embeddings=4096, rope_theta=1e6, pad_token_id=tok.pad_token_id,
                       eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, **SHAPES[a.shape])
    mcfg._attn_implementation = "sdpa"
    with torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if gpu else "cpu"):
        model = Qwen3ForCausalLM(mcfg)
    task = bench_task()
    times: list[dict] = []
    from gearlab.rollout.factory import resolve_engine

    cfg.rollout.engine = resolve_engine(cfg, model)  # as gearlab train does: the JSON names the engine that ran

    module = timed_module(GRPOModule, times)(
        cfg, model, tok, task, build(cfg.assigner.name, dict(cfg.assigner.options))
    )
    dm = PromptDataModule(task, prompts_per_step=PROMPTS, num_steps=a.iters, seed=0, pool_size=PROMPTS * a.iters)
    trainer = L.Trainer(accelerator="gpu" if gpu else "cpu", devices=a.devices, strategy=distributed.make_strategy(cfg),
                        precision=cfg.trainer.precision, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        use_distributed_sampler=False)
    trainer.fit(module, datamodule=dm)
    if trainer.is_global_zero:
        tot = [sum(v for k, v in t.items() if k.startswith("time_")) for t in times]
        s_iter = statistics.median(tot[a.warmup:] or tot)
        later = times[a.warmup:] or times
        med = lambda k: round(statistics.median([t[k] for t in later]), 2)  # noqa: E731
        tokens = PROMPTS * G * (64 + a.new)
        engine_keys = sorted({k for t in later for k in t if k.startswith(("fast/", "vllm/", "engine_"))})
        res = {"shape": a.shape, "assigner": a.assigner, "strategy": a.strategy, "devices": a.devices,
               "engine": cfg.rollout.engine, "sharded_weights": a.sharded_weights, "vllm_tp": a.tp, "overrides": a.set,
               "sequences": PROMPTS * G,
               "new_tokens": a.new, "s_per_iter_all": [round(t, 2) for t in tot],
               "phases_all": [{k[5:]: round(v, 2) for k, v in t.items() if k.startswith("time_")} for t in times],
               "warmup_iters": a.warmup,
               "s_per_iter": round(s_iter, 2), "rollout_s": med("time_rollout_s"),
               "signals_credit_s": med("time_signals_credit_s"), "update_s": med("time_update_s"),
               "tokens_per_s": round(tokens / s_iter),
               "response_len_mean": round(statistics.mean(t["response_len"] for t in times), 1),
               "peak_mem_gib_rank0": round(max(t["peak_gib"] for t in times), 2),
               "engine_stats": {k: round(statistics.median([t[k] for t in later if k in t]), 4) for k in engine_keys},
               "device": torch.cuda.get_device_name(0) if gpu else "cpu", "torch": torch.__version__}
        print(json.dumps(res))
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
