"""Does gearlab's CPU kernel pin give the same digits on this machine as on another CPU class?

Runs one small workload of the kind gearlab's CPU path runs — a 2-layer Qwen3 built from config (seeded), 60 AdamW
steps of next-token loss with SDPA attention and gradient clipping, then 64 tokens sampled for 16 rows with HF
``generate`` — twice, each in its own process: with the kernels pinned (gearlab.cpu_kernels) and with the machine's
own choice (``GEARLAB_CPU_KERNELS=native``). Prints one JSON line: the CPU model, the instruction set ATen used and
the SHA-256 of the final weights and of the sampled tokens for each. Run it on two machines with the same torch and
transformers versions: the pinned digests must be equal; the native ones may differ.

    python experiments/cpu_class_check.py [--threads 2] [--steps 60]

Needs only torch and transformers (no gearlab dependencies), so it also runs in a GPU machine's own image.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def workload(threads: int, steps: int) -> dict[str, str]:
    """The digests of one seeded train-then-sample run in this process (kernels as the environment says)."""
    sys.path.insert(0, str(ROOT))
    import gearlab  # noqa: F401  (pins the kernels unless GEARLAB_CPU_KERNELS=native)
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gearlab.cpu_kernels import describe

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    model = Qwen3ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.98), weight_decay=0.01, fused=True)
    g = torch.Generator().manual_seed(1)
    # a learnable pattern (each row counts up from a random start), so the loss moves and rounding compounds
    for _ in range(steps):
        start = torch.randint(0, 400, (32, 1), generator=g)
        ids = (start + torch.arange(48)) % 512
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    w = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        w.update(name.encode())
        w.update(p.detach().contiguous().numpy().tobytes())
    model.eval()
    torch.manual_seed(2)
    prompt = torch.randint(0, 512, (16, 8), generator=g)
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, top_k=0, top_p=1.0,
                         max_new_tokens=64, pad_token_id=0)
    return {**describe(), "torch": torch.__version__, "loss": f"{loss.item():.9g}",
            "weights_sha256": w.hexdigest()[:16],
            "tokens_sha256": hashlib.sha256(out.numpy().tobytes()).hexdigest()[:16]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--one", choices=["pinned", "native"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(workload(a.threads, a.steps)))
        return
    res = {}
    for mode in ("pinned", "native"):
        env = {
            k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")
        }
        if mode == "native":
            env["GEARLAB_CPU_KERNELS"] = "native"
        out = subprocess.run([sys.executable, __file__, "--one", mode, "--threads", str(a.threads), "--steps",
                              str(a.steps)], env=env, capture_output=True, text=True, check=True)
        res[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(res))


if __name__ == "__main__":
    main()
