"""Decode attention alone: the kernels that could run the fast path's attention over its static KV cache.

    python experiments/bench/decode_attention.py --out decode_attention.json     # a CUDA GPU

Shape (the benchmark's Qwen3-0.6B step): batch 128, 16 query heads over 8 K/V heads, head dim 128, bf16, one query
position, 28 layers each with its own cache (so nothing stays in L2), attention over the first L positions (the
bucket) under a boolean mask (left padding, unfilled positions). Each variant's sweep of the 28 layers is captured in
one CUDA graph and replayed, so launch overhead is not counted. Per variant and L: microseconds per layer and the
effective bandwidth of reading K and V (the floor: 2 · B · H_kv · L · D · 2 bytes per layer).

Variants:
  sdpa_grouped     the fast path's folded form: SDPA with the 2 query heads of a K/V head as its 2 query positions,
                   boolean mask; PyTorch picks the backend (cuDNN on H100/H200 with torch 2.11: ``sdpa_auto``)
  sdpa_efficient   the same, the memory-efficient backend forced (what the default ``rollout.fast.attention=sdpa``
                   runs: SDPA without cuDNN, and flash takes no mask)
  sdpa_math        the same, the math backend forced
  sdpa_cudnn       the same, the cuDNN backend forced
  sdpa_gqa         SDPA with 16 query heads and ``enable_gqa=True``, boolean mask (and its _cudnn, _efficient forced)
  flex_decode      ``flex_attention`` compiled (its decoding kernel for short queries), GQA, the mask as a mask_mod
                   over a block mask built for the bucket (built outside the timed loop)
  split            gearlab's split-K Triton kernel (``rollout.fast.attention=split``, gearlab.rollout.split_decode)
Each variant's output is compared with sdpa_math's (max |Δ|); ``split_distinct_of_20`` counts the distinct outputs of
20 runs of the split kernel on the same inputs. ``--batch`` and ``--lengths`` set the shape (reasoning lengths:
``--lengths 1024,2048``; a small batch: ``--batch 16``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

B, HQ, HKV, D, LAYERS, PROMPT = 128, 16, 8, 128, 28, 64


def _time(fn, backend=None, reps: int = 50) -> float:
    """Mean microseconds per layer of ``fn`` (a sweep over all layers) captured in one CUDA graph and replayed
    ``reps`` times: kernel time without launch gaps, as the fast path runs it. ``backend`` forces an SDPA backend
    for the warm-up and the capture."""
    from contextlib import nullcontext

    from torch.nn.attention import sdpa_kernel

    ctx = (lambda: sdpa_kernel([backend])) if backend is not None else nullcontext
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), ctx():
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), ctx():
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / reps / LAYERS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="decode_attention.json")
    ap.add_argument("--lengths", default="128,192,256,320")
    ap.add_argument("--batch", type=int, default=B)
    a = ap.parse_args()
    _run(a.out, [int(x) for x in a.lengths.split(",")], a.batch)


def _run(out_path: str, lengths: list[int], B: int) -> None:  # noqa: C901 — one sweep over variants, read top down
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    from gearlab.rollout.split_decode import SplitDecode

    split = SplitDecode()
    Lmax = max(lengths)
    ks = [torch.randn(B, HKV, Lmax, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(LAYERS)]
    vs = [torch.randn(B, HKV, Lmax, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(LAYERS)]
    q = torch.randn(B, HQ, 1, D, device=dev, dtype=torch.bfloat16, generator=g)
    n_prompt = torch.randint(8, PROMPT + 1, (B,), device=dev, generator=g)
    key_ok = torch.ones(B, Lmax, dtype=torch.bool, device=dev)
    key_ok[:, :PROMPT] = torch.arange(PROMPT, device=dev)[None] >= (PROMPT - n_prompt)[:, None]  # left padding
    res: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                 "shape": f"B={B}, {HQ} query heads / {HKV} K/V heads, D={D}, bf16, {LAYERS} layers", "lengths": {}}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
    except Exception as e:  # noqa: BLE001 — report and go on
        flex, res["flex_error"] = None, f"{type(e).__name__}: {e}"[:300]
    for L in lengths:
        at = L - 17  # the position being written: the last 16 of the bucket are not filled yet
        visible = key_ok[:, :L] & (torch.arange(L, device=dev) <= at)
        mask = visible[:, None, None, :]
        qg = q.reshape(B, HKV, HQ // HKV, D)

        def grouped(i):
            return F.scaled_dot_product_attention(
                qg, ks[i][:, :, :L], vs[i][:, :, :L], attn_mask=mask
            ).reshape(B, HQ, 1, D)

        def sweep(f):
            return lambda: [f(i) for i in range(LAYERS)]

        row: dict = {"floor_MB_per_layer": round(2 * B * HKV * L * D * 2 / 1e6, 1)}
        with sdpa_kernel([SDPBackend.MATH]):
            ref = grouped(0).float()
        variants = {"sdpa_grouped": (grouped, None), "sdpa_efficient": (grouped, SDPBackend.EFFICIENT_ATTENTION),
                    "sdpa_math": (grouped, SDPBackend.MATH), "sdpa_cudnn": (grouped, SDPBackend.CUDNN_ATTENTION)}

        def gqa(i):
            return F.scaled_dot_product_attention(q, ks[i][:, :, :L], vs[i][:, :, :L], attn_mask=mask, enable_gqa=True)

        variants.update({"sdpa_gqa": (gqa, None), "sdpa_gqa_cudnn": (gqa, SDPBackend.CUDNN_ATTENTION),
                         "sdpa_gqa_efficient": (gqa, SDPBackend.EFFICIENT_ATTENTION),
                         "split": (lambda i: split(q, ks[i][:, :, :L], vs[i][:, :, :L], visible, D ** -0.5), None)})
        try:
            row["split_distinct_of_20"] = len({variants["split"][0](0).view(torch.int16).cpu().numpy().tobytes()
                                             for _ in range(20)})
        except Exception as e:  # noqa: BLE001
            row["split_error"] = f"{type(e).__name__}: {e}"[:300]
        if flex is not None:
            def mask_mod(b, h, q_idx, kv_idx):
                return visible[b, kv_idx]
            try:
                bm = create_block_mask(mask_mod, B, None, 1, L, device=dev)
                variants["flex_decode"] = (
                    lambda i: flex(q, ks[i][:, :, :L], vs[i][:, :, :L], block_mask=bm, enable_gqa=True), None
                )
            except Exception as e:  # noqa: BLE001
                row["flex_decode_error"] = f"{type(e).__name__}: {e}"[:300]
        for name, (f, backend) in variants.items():
            try:
                us = _time(sweep(f), backend)
                if backend is None:
                    out = f(0)
                else:
                    with sdpa_kernel([backend]):
                        out = f(0)
                row[name] = {"us_per_layer": round(us, 1), "GB_per_s": round(row["floor_MB_per_layer"] / us * 1e3, 0),
                             "max_abs_diff_vs_math": float((out.float() - ref).abs().max())}
            except Exception as e:  # noqa: BLE001 — one variant failing leaves the others
                row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        res["lengths"][str(L)] = row
        print(json.dumps({L: row}), flush=True)
    Path(out_path).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
