"""The small model the FSDP2 worker tests shard, and the gloo process group they join."""
from __future__ import annotations

import torch
import torch.distributed as dist

from gearlab.models.tiny import build_tiny_model, build_tokenizer


def small_model(tok) -> torch.nn.Module:
    """A 2-layer Qwen3-shaped model (hidden 64, 4 query / 2 K/V heads of 16), seed 0: the same on every rank."""
    return build_tiny_model(tok, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                            intermediate_size=128, seed=0)


def join_gloo(rank: int, world: int, init: str) -> tuple[object, torch.nn.Module]:
    """Join a gloo group of ``world`` processes (file rendezvous at ``init``), one thread; (tokenizer, small model)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    tok = build_tokenizer()
    return tok, small_model(tok)
