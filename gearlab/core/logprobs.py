"""Per-token log-probs, entropy and teacher KL from hidden states, in position chunks.

The LM head runs on ``chunk_size`` positions at a time and only the [B, T] results are kept, so a
float32 B×T×V logits tensor never exists (Qwen3's V = 151,936 makes it GBs). With gradients,
each chunk is recomputed in the backward pass (activation checkpointing of the head), so the
autograd graph does not keep the chunk's logits either. Logits are divided by the sampling
temperature first, as verl and TRL do (docs/grpo.md#log-probs-at-the-sampling-temperature).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from gearlab.parallel.compiling import compiled_function
from gearlab.parallel.distributed import is_fsdp1


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """[B, L] → [B, L] position ids that skip left padding (as HF ``generate`` builds them)."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp_(min=0)


def response_hidden(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_len: int, response_len: int,
                    *, packed: bool = False) -> Tensor:
    """Last hidden states at the positions that PREDICT the response tokens.

    input_ids / attention_mask: [B, P+T] (prompt left-padded to P, response right-padded to T).
    Returns [B, T, H]: hidden state at position P-1+t predicts response token t (0 where t is padding).

    packed=True: no compute on padding. The real tokens of all rows are concatenated into ONE sequence
    [1, N] (N = Σ real lengths) with per-row position ids and a block-diagonal causal mask, so no token
    attends across rows; the result equals the padded path's (tested). The [1, 1, N, N] boolean mask costs
    N² bytes: meant for micro-batches of a few thousand tokens (a varlen attention kernel would remove it).
    """
    if packed:
        return _packed_response_hidden(model, input_ids, attention_mask, prompt_len, response_len)
    out = _last_hidden(model, input_ids, attention_mask, position_ids_from_mask(attention_mask))
    return out[:, prompt_len - 1 : prompt_len - 1 + response_len]


def _last_hidden(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
    # Through the model's OWN forward (not its base model's), so a sharded root (FSDP2) gathers its
    # parameters — embeddings, final norm, head — as it does for any forward, and keeps them gathered
    # for the chunked head. ``logits_to_keep=1``: the full-vocabulary head runs on one position.
    base = getattr(model, model.base_model_prefix)
    captured: list[Tensor] = []
    handle = base.register_forward_hook(lambda m, args, out: captured.append(
        out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]))
    try:
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                    logits_to_keep=1)
    finally:
        handle.remove()
    hidden = captured[-1]
    if torch.is_grad_enabled() and is_fsdp1(model):
        # FSDP1 finishes a backward (reduce-scatter, gradients into the flat parameters) from hooks on the
        # root's OUTPUTS; the loss reaches the root through these hidden states, so tie one output in (× 0)
        hidden = hidden + 0.0 * out.logits.sum().to(hidden.dtype)
    return hidden


def _packed_response_hidden(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_len: int,
                            response_len: int) -> Tensor:
    real = attention_mask.bool()
    lens = real.sum(1)  # [B]
    B, dev = input_ids.shape[0], input_ids.device
    ids = input_ids[real][None]  # [1, N]: row 0's prompt+response, then row 1's, ...
    pos = position_ids_from_mask(attention_mask)[real][None]  # the padded path's positions, 0.. per row
    seg = torch.repeat_interleave(torch.arange(B, device=dev), lens)
    N = ids.shape[1]
    block = torch.ones(N, N, dtype=torch.bool, device=dev).tril_() & (seg[:, None] == seg[None, :])
    hidden = _last_hidden(model, ids, block[None, None], pos)[0]  # [N, H]
    start = lens.cumsum(0) - lens
    n_prompt = real[:, :prompt_len].sum(1)
    n_resp = real[:, prompt_len:].sum(1)
    t = torch.arange(response_len, device=dev)
    valid = t[None] < n_resp[:, None]  # [B, T]
    idx = torch.where(
        valid, start[:, None] + n_prompt[:, None] - 1 + t[None], torch.zeros_like(valid, dtype=torch.long)
    )
    return hidden[idx] * valid[..., None].to(hidden.dtype)


def _chunk_stats(
    hidden: Tensor, head: nn.Module, targets: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor]:
    logits = head(hidden).float() / temperature  # [n, V]
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        ent = lse - (probs * logits).sum(-1)
    else:
        ent = torch.zeros_like(logp)
    return logp, ent


def token_logprobs(
    hidden: Tensor,
    head: nn.Module,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 256,
    with_entropy: bool = False,
    compiled: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """log π(y_t) and (optionally) the entropy H_t, chunked over the B·T positions.

    hidden [B, T, H], targets [B, T] long → (logprobs [B, T] float32, entropy [B, T] float32 | None).
    Differentiable when ``hidden`` requires grad (the head's logits are recomputed in backward).
    ``compiled``: each chunk's head matmul, cast, logsumexp and gather run as one torch.compile'd graph.
    """
    stats = compiled_function(_chunk_stats, compiled)
    B, T, Hd = hidden.shape
    flat_h, flat_y = hidden.reshape(B * T, Hd), targets.reshape(B * T)
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    lps, ents = [], []
    for s in range(0, B * T, chunk_size):
        h, y = flat_h[s : s + chunk_size], flat_y[s : s + chunk_size]
        if need_grad:
            lp, ent = checkpoint(stats, h, head, y, temperature, with_entropy, use_reentrant=False)
        else:
            lp, ent = stats(h, head, y, temperature, with_entropy)
        lps.append(lp)
        ents.append(ent)
    logp = torch.cat(lps).view(B, T) if lps else hidden.new_zeros(B, T, dtype=torch.float32)
    ent_out = (torch.cat(ents).view(B, T) if ents else logp.new_zeros(B, T)) if with_entropy else None
    return logp, ent_out


def _chunk_kl(hs: Tensor, ht: Tensor, head: nn.Module, thead: nn.Module, temperature: float) -> Tensor:
    ls = F.log_softmax(head(hs).float() / temperature, dim=-1)
    lt = F.log_softmax(thead(ht).float() / temperature, dim=-1)
    return (ls.exp() * (ls - lt)).sum(-1)


@torch.no_grad()
def token_kl(student_hidden: Tensor, teacher_hidden: Tensor, head: nn.Module, *, temperature: float = 1.0,
             chunk_size: int = 256, teacher_head: nn.Module | None = None, compiled: bool = False) -> Tensor:
    """Full-vocabulary reverse KL(π_S ‖ π_T) at every position, in chunks, without gradient.

    student_hidden, teacher_hidden [B, T, H] (aligned on the same response tokens) → [B, T] float32, nats.
    ``teacher_head``: the teacher's LM head when its weights differ (frozen / EMA teacher); default ``head``.
    ``compiled``: each chunk's two heads and the KL run as one torch.compile'd graph.
    """
    thead = head if teacher_head is None else teacher_head
    kl = compiled_function(_chunk_kl, compiled)
    B, T, Hd = student_hidden.shape
    hs, ht = student_hidden.reshape(B * T, Hd), teacher_hidden.reshape(B * T, Hd)
    out = []
    for s in range(0, B * T, chunk_size):
        out.append(kl(hs[s : s + chunk_size], ht[s : s + chunk_size], head, thead, temperature))
    return torch.cat(out).view(B, T) if out else student_hidden.new_zeros(B, T, dtype=torch.float32)


def naive_token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Reference implementation on full logits [B, T, V] (tests only): (logprobs, entropy) [B, T]."""
    lp = F.log_softmax(logits.float() / temperature, dim=-1)
    return lp.gather(-1, targets[..., None]).squeeze(-1), -(lp.exp() * lp).sum(-1)
