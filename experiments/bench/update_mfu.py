"""Update-phase throughput and MFU of gearlab's GRPO update under FSDP2, 1 or more GPUs.

    python experiments/bench/update_mfu.py --shape qwen3-0.6b --devices 1 --out r.json
    python experiments/bench/update_mfu.py --shape qwen3-1.7b --devices 2 --micro-batch 8 --out r.json

Runs the real training path — ``GRPOModule._update`` under Lightning's ``ModelParallelStrategy`` (FSDP2,
bf16 compute, fp32 master weights and reduction), chunked log-prob head, global-count loss aggregation —
on a synthetic rollout batch: ``--prompts`` × G=8 sequences of ``--prompt-len`` + ``--response-len`` tokens
(random ids, random advantages) and a random-weight model with the Qwen3 shape (nothing is downloaded).
It times ``--iters`` update phases after one warm-up. Each rank holds prompts/devices prompts: the global
batch is the same for any number of GPUs, so tokens/s compare directly.

MFU = model FLOPs / (time × devices × peak). Model FLOPs per trained token = 6·N + 12·L·H·S (PaLM's
accounting: N = non-embedding parameters + the LM head, L layers, H hidden size, S sequence length);
recomputation (activation checkpointing, the checkpointed head) is not counted. Peak: 989.4 TFLOP/s bf16
dense for H100 SXM / H200.
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

SHAPES = {  # Qwen3 configs (hidden, intermediate, layers, heads, kv heads, head_dim); vocab 151,936, tied ≤1.7B
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
}
PEAK_BF16 = 989.4e12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=1792)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--checkpointing", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--chunk-size", type=int, default=1024, help="positions per chunk of the log-prob head")
    ap.add_argument(
        "--cpu-offload", type=int, default=0, help="FSDP2 CPU offload of parameters, grads, optimizer state"
    )
    ap.add_argument("--compile", type=int, default=0, help="trainer.compile: compiled decoder layers and head chunks")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    import lightning as L
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gearlab.parallel import distributed
    from gearlab.core.batch import RolloutBatch
    from gearlab.config import load_config
    from gearlab.credit import build
    from gearlab.models.tiny import build_tokenizer
    from gearlab.trainer.module import GRPOModule
    from gearlab.tasks.registry import get_task

    gpu = torch.cuda.is_available()
    G, V = 8, 151_936
    cfg = load_config([f"trainer.devices={a.devices}", "trainer.strategy=fsdp2",
                       f"trainer.accelerator={'gpu' if gpu else 'cpu'}",
                       f"trainer.precision={'bf16-mixed' if gpu else '32-true'}",
                       f"trainer.activation_checkpointing={bool(a.checkpointing)}",
                       f"algorithm.micro_batch_size={a.micro_batch}", f"rollout.prompts_per_step={a.prompts}",
                       f"rollout.group_size={G}", "rollout.engine=hf", "model.dtype=float32",
                       f"signals.chunk_size={a.chunk_size}",
                       f"trainer.cpu_offload={bool(a.cpu_offload)}", f"trainer.compile={bool(a.compile)}"])
    torch.manual_seed(0)
    mcfg = Qwen3Config(vocab_size=V, max_position_embeddings=8192, rope_theta=1e6, **SHAPES[a.shape])
    mcfg._attn_implementation = "sdpa"
    # built on this rank's GPU (a 4B/8B fp32 model initialised on the CPU by 4–8 ranks at once takes minutes);
    # fully_shard then keeps only this rank's shard and the full tensors are freed
    with torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if gpu else "cpu"):
        model = Qwen3ForCausalLM(mcfg)
    n_total = sum(p.numel() for p in model.parameters())
    H, Lyr, S = mcfg.hidden_size, mcfg.num_hidden_layers, a.prompt_len + a.response_len
    # N = non-embedding params + the head; with tied embeddings the one V×H matrix is the head
    n_eff = n_total if mcfg.tie_word_embeddings else n_total - V * H
    flops_per_token = 6 * n_eff + 12 * Lyr * H * S
    B = a.prompts * G

    class Bench(GRPOModule):
        def training_step(self, batch, batch_idx):
            w, r = self.trainer.world_size, self.trainer.global_rank
            g = torch.Generator().manual_seed(1000 + r)
            b = B // w
            dev = self.device
            rb = RolloutBatch(prompt_ids=torch.randint(10, V, (b, a.prompt_len), generator=g).to(dev),
                              prompt_mask=torch.ones(b, a.prompt_len, dtype=torch.long, device=dev),
                              response_ids=torch.randint(10, V, (b, a.response_len), generator=g).to(dev),
                              response_mask=torch.ones(b, a.response_len, dtype=torch.bool, device=dev),
                              group_ids=(torch.arange(b) // G).to(dev), rewards=torch.rand(b, generator=g).to(dev))
            adv = torch.randn(b, a.response_len, generator=g).to(dev)
            self.times = []
            for i in range(a.iters + 1):
                if gpu:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                self._global_sum(1.0)  # a barrier
                t0 = time.perf_counter()
                self._update(rb, adv, rb.response_mask, it=i)
                if gpu:
                    torch.cuda.synchronize()
                self._global_sum(1.0)
                self.times.append(time.perf_counter() - t0)
            self.peak_gib = torch.cuda.max_memory_allocated() / 2**30 if gpu else float("nan")
            self.reserved_gib = torch.cuda.max_memory_reserved() / 2**30 if gpu else float("nan")

    module = Bench(cfg, model, build_tokenizer(), get_task("arith"), build("grpo"))
    trainer = L.Trainer(accelerator="gpu" if gpu else "cpu", devices=a.devices, strategy=distributed.make_strategy(cfg),
                        precision=cfg.trainer.precision, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=[{"iteration": 0}])
    if trainer.is_global_zero:
        t = sorted(module.times[1:])[len(module.times[1:]) // 2]  # median after warm-up
        tokens = B * S  # every position is a forward/backward position (prompt + response)
        res = {"shape": a.shape, "params": n_total, "devices": a.devices, "sequences": B, "seq_len": S,
               "micro_batch": a.micro_batch, "cpu_offload": bool(a.cpu_offload), "compile": bool(a.compile),
               "activation_checkpointing": bool(a.checkpointing), "chunk_size": a.chunk_size,
               "update_s_median": round(t, 3), "update_s_all": [round(x, 3) for x in module.times],
               "tokens_per_s": round(tokens / t), "tokens_per_s_per_gpu": round(tokens / t / a.devices),
               "mfu": round(flops_per_token * tokens / t / (a.devices * PEAK_BF16), 4) if gpu else None,
               "peak_mem_gib_rank0": round(module.peak_gib, 2), "peak_reserved_gib_rank0": round(module.reserved_gib,
               2),
               "device": torch.cuda.get_device_name(0) if gpu else "cpu",
               "torch": torch.__version__}
        print(json.dumps(res))
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
