"""Whether the signals step of a training iteration repeats bit for bit on this card: ``SignalProvider.compute``
(student entropy, teacher log-probs and KL over a privileged prompt, the passes GEAR's credit reads) on one fixed
left-padded batch, ``--repeats`` times in each of two modes:

  default   gearlab's provider as it is (SDPA without cuDNN's attention, ``gearlab.core.sdpa``)
  cudnn     the same with SDPA's own backend choice (cuDNN's attention on Hopper), as before 2026-12-04

and one masked SDPA call at the batch's widths with cuDNN's backend alone, ``--repeats`` times on fixed inputs; then
the per-group sums of the advantage computations, 4,096 float64 values of spread magnitudes into one bin (GEAR's
batch normalisation) and into 64 (group statistics), with CUDA's ``index_add_`` and with ``gearlab.core.reduce.bin_sum``
(which must also equal the CPU's sum bit for bit).
Each mode reports how many distinct digests (SHA-256 of every output's bytes) its repeats gave: 1 = repeatable.

    python experiments/gpu/signal_determinism_check.py --out signal_check.json   # a CUDA GPU; a CPU runs too

The model is SmolLM2-135M's shape (30 layers, 9 heads over 3 K/V heads of 64) with seeded random bf16 weights; the
batch is 64 rows of 32–160 prompt tokens (teacher prompts 64 longer) and 24–256 response tokens.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gearlab.signals.provider as provider  # noqa: E402
from gearlab.core.batch import RolloutBatch  # noqa: E402
from gearlab.core.reduce import bin_sum  # noqa: E402
from gearlab.credit import Signal  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NEEDS = frozenset({Signal.ENTROPY, Signal.TEACHER_LOGPROBS, Signal.TEACHER_KL})


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(DEV, torch.bfloat16).eval()


def _left_padded(lengths: torch.Tensor, width: int, g: torch.Generator, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(5, V, (len(lengths), width), generator=g)
    mask = torch.arange(width)[None] >= (width - lengths)[:, None]
    return (ids * mask).to(DEV), mask.long().to(DEV)


def _batch(V: int, B: int = 64) -> RolloutBatch:
    g = torch.Generator().manual_seed(1)
    plen = torch.randint(32, 161, (B,), generator=g)
    prompt, pmask = _left_padded(plen, 160, g, V)
    tprompt, tmask = _left_padded(plen + 64, 224, g, V)
    rlen = torch.randint(24, 257, (B,), generator=g)
    rmask = (torch.arange(256)[None] < rlen[:, None]).to(DEV)
    resp = (torch.randint(5, V, (B, 256), generator=g).to(DEV) * rmask)
    return RolloutBatch(prompt_ids=prompt, prompt_mask=pmask, response_ids=resp, response_mask=rmask,
                        group_ids=torch.arange(B, device=DEV) // 8, rewards=torch.zeros(B, device=DEV),
                        teacher_prompt_ids=tprompt, teacher_prompt_mask=tmask)


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _signals(model, batch, repeats: int, cudnn: bool) -> list[str]:
    saved = provider.reproducible_attention
    if cudnn:  # the provider as it was: every SDPA backend allowed
        provider.reproducible_attention = contextlib.nullcontext
    try:
        sp = provider.SignalProvider(model, temperature=1.0, micro_batch_size=16)
        out = []
        for _ in range(repeats):
            ppass, sig = sp.compute(batch, NEEDS)
            out.append(_digest([ppass.logprobs] + [sig[s] for s in sorted(sig, key=str)]))
        return out
    finally:
        provider.reproducible_attention = saved


def _cudnn_op(repeats: int) -> list[str] | str:
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(16, 9, 416, 64, generator=g).to(DEV, torch.bfloat16) for _ in range(3))
    keep = torch.arange(416)[None] >= torch.randint(0, 200, (16,), generator=g)[:, None]
    mask = (torch.ones(416, 416, dtype=torch.bool).tril()[None] & keep[:, None, :])[:, None].to(DEV)
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return [_digest([F.scaled_dot_product_attention(q, k, v, attn_mask=mask)]) for _ in range(repeats)]
    except RuntimeError as e:  # no cuDNN attention here (a CPU, or this shape unsupported)
        return f"unavailable: {str(e).splitlines()[0][:160]}"


def _sums(repeats: int) -> dict:
    g = torch.Generator().manual_seed(3)
    values = (torch.randn(4096, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-6, 6, (4096,), generator=g))
    res = {}
    for n in (1, 64):
        index = torch.randint(0, n, (4096,), generator=g)
        cpu = _digest([bin_sum(values, index, n)])
        v, i = values.to(DEV), index.to(DEV)
        atomic = [_digest([torch.zeros(n, dtype=v.dtype, device=DEV).index_add_(0, i, v)]) for _ in range(repeats)]
        ours = [_digest([bin_sum(v, i, n)]) for _ in range(repeats)]
        res[f"bins_{n}"] = {"index_add_distinct": len(set(atomic)), "bin_sum_distinct": len(set(ours)),
                            "bin_sum_equals_cpu": set(ours) == {cpu}}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--rows", type=int, default=64, help="rows of the batch (fewer: a quick run on a CPU)")
    ap.add_argument("--out", type=Path, default=Path("signal_check.json"))
    a = ap.parse_args()
    model = _model()
    batch = _batch(model.config.vocab_size, a.rows)
    res = {"device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu", "torch": torch.__version__,
           "cudnn_version": torch.backends.cudnn.version(), "repeats": a.repeats, "rows": a.rows}
    with torch.no_grad():
        for mode in ("default", "cudnn"):
            d = _signals(model, batch, a.repeats, cudnn=mode == "cudnn")
            res[mode] = {"distinct": len(set(d)), "digests": d}
        op = _cudnn_op(a.repeats)
        res["cudnn_op"] = op if isinstance(op, str) else {"distinct": len(set(op)), "digests": op}
        res["sums"] = _sums(max(a.repeats, 20))
    a.out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: (v.get("distinct", v) if isinstance(v, dict) else v) for k, v in res.items()}))


if __name__ == "__main__":
    main()
