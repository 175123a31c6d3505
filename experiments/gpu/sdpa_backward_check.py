"""Whether SDPA's backward on this card and torch gives finite gradients for the inputs the trainer feeds it, with
every backend allowed (SDPA's default choice) and under ``gearlab.core.sdpa.differentiable_attention`` (no cuDNN).

    python experiments/gpu/sdpa_backward_check.py --out sdpa_check.json     # a CUDA GPU; CPU runs too (no cuDNN)

Two probes, each at key lengths 640, 704 and 768 (704 ≡ 64 mod 128, the remainder of pytorch/pytorch#196678):
  op      one masked bf16 attention [2, 4, L, 64] whose first row of batch 1 is left padding (a fully masked query
          row: log-sum-exp −inf), backward of a random cotangent; counts the non-finite elements of dq, dk, dv
  model   a Llama-shaped model (4 layers, 9 heads over 3 K/V heads, SmolLM2's head layout) under bf16 autocast,
          ``gearlab.core.logprobs.response_hidden`` of a left-padded micro-batch of total width L, a log-prob loss,
          backward; counts the parameters with a non-finite gradient
Each result names the backend SDPA chose (from the autograd graph's node name).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gearlab.core.logprobs import response_hidden, token_logprobs  # noqa: E402
from gearlab.core.sdpa import differentiable_attention  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _op(L: int, safe: bool) -> dict:
    g = torch.Generator(device="cpu").manual_seed(L)
    q, k, v = (torch.randn(2, 4, L, 64, generator=g).to(DEV, torch.bfloat16).requires_grad_() for _ in range(3))
    keep = torch.ones(2, L, dtype=torch.bool)
    keep[1, :37] = False  # batch row 1: 37 positions of left padding
    mask = (torch.ones(L, L, dtype=torch.bool).tril()[None] & keep[:, None, :])[:, None].to(DEV)
    with differentiable_attention() if safe else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.backward(torch.randn(out.shape, generator=g).to(DEV, out.dtype))
    return {"backend": type(out.grad_fn).__name__,
            **{f"nonfinite_d{n}": int((~torch.isfinite(t.grad)).sum()) for n, t in zip("qkv", (q, k, v))}}


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(DEV)


def _through_model(model: torch.nn.Module, L: int, safe: bool) -> dict:
    g = torch.Generator().manual_seed(L)
    B, T = 8, 96
    P = L - T
    ids = torch.randint(1, 512, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    for i in range(B):  # left padding of different lengths; row 0 none
        mask[i, : 11 * i] = 0
    ids, mask = ids.to(DEV), mask.to(DEV)
    model.zero_grad(set_to_none=True)
    with torch.autocast(DEV.type, dtype=torch.bfloat16), (
            differentiable_attention() if safe else contextlib.nullcontext()):
        h = response_hidden(model, ids, mask, P, T)
        lp, _ = token_logprobs(h, model.get_output_embeddings(), ids[:, P:], temperature=1.0, chunk_size=256)
        loss = -lp.float().mean()
    loss.backward()
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    return {"loss": float(loss.detach()), "params_nonfinite_grad": len(bad), "first": bad[:3]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="sdpa_check.json")
    args = ap.parse_args()
    res: dict = {"device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu", "torch": torch.__version__,
                 "cudnn": torch.backends.cudnn.version() if DEV.type == "cuda" else None}
    model = _model()
    for L in (640, 704, 768):
        for safe in (False, True):
            key = f"L{L}_{'no_cudnn' if safe else 'default'}"
            res[key] = {"op": _op(L, safe), "model": _through_model(model, L, safe)}
            print(key, json.dumps(res[key]), flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
