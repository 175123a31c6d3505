"""``sum_pi_squared``: the policy's collision probability Σ_v π(v | x, y_<t)² at each response position.

With the sampled token's probability π_t, ``1 − 2 π_t + Σπ²`` = ‖e_{y_t} − π‖², the squared norm of the log-prob
gradient with respect to the logits: the per-token "realized energy" of the optimal token baseline (assigners/otb.py).
Computed as verl computes it, ``exp(logsumexp(2 z) − 2 logsumexp(z))`` of the logits z at the sampling temperature,
in float32, with one extra no-grad policy forward (micro-batched, the head in position chunks).
"""
from __future__ import annotations

import torch
from torch import Tensor

from gearlab.core.logprobs import response_hidden
from gearlab.signals.registry import SignalContext, register_signal

SUM_PI_SQUARED = "sum_pi_squared"


def collision_from_logits(logits: Tensor) -> Tensor:
    """Σ_v softmax(z)_v² over the last dimension, from logits z [..., V] (float32 result [...])."""
    z = logits.float()
    return torch.exp(torch.logsumexp(2 * z, dim=-1) - 2 * torch.logsumexp(z, dim=-1))


@register_signal(SUM_PI_SQUARED, fake="prob")
@torch.no_grad()
def sum_pi_squared(ctx: SignalContext) -> Tensor:
    """Σ_v π(v | context)² of the policy at each response position, at the sampling temperature ([B, T] float32)."""
    b = ctx.batch
    head = ctx.model.get_output_embeddings()
    out = []
    for s in range(0, b.batch_size, ctx.micro_batch_size):
        mb = b.select(torch.arange(s, min(s + ctx.micro_batch_size, b.batch_size), device=b.response_ids.device))
        h = response_hidden(ctx.model, mb.input_ids(), mb.full_attention_mask(), mb.prompt_ids.shape[1],
                            mb.response_len)  # [b, T, H]
        flat = h.reshape(-1, h.shape[-1])
        vals = [collision_from_logits(head(flat[i : i + ctx.chunk_size]).float() / ctx.temperature)
                for i in range(0, flat.shape[0], ctx.chunk_size)]
        out.append(torch.cat(vals).view(h.shape[:2]))
    return torch.cat(out) * b.response_mask.float()
