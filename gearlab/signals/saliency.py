"""Model-based saliency signals of OAR (docs/credit/oar.md#saliency-signals): the shared pieces and OAR-G.

Both signals (OAR-G here, OAR-P in gearlab.signals.perturbation) score every **reasoning** token
(gearlab.signals.spans) by how much it matters for the model's outcome distribution p_final, and are
0 elsewhere; both are [B, T] float32 ≥ 0.

Outcome distribution (option ``pfinal_mode``; logits divided by the sampling temperature [INF]):

  "last"          the next-token distribution at the position that predicts the first token of
                  the answer value, i.e. after the marker "Answer:" (the source scores the last
                  position of before ⊕ reasoning ⊕ conclude [SRC]; mapping "conclude" to the
                  marker is [INF]). Without a marker this is the last reasoning position.
                  ``answer_anchor="span"`` moves it to the last reasoning position, right before
                  the marker [PROPOSED alternative].
  "answer_mean"   softmax of the MEAN of the logits at the positions predicting the answer-value
                  tokens (the source's helper is named ``mean_answer_logits...`` [SRC name], so the
                  logits, not the probabilities, are averaged [INF]).
  "answer_joint"  φ = mean log-likelihood of the answer-value tokens [SRC]; effects are φ − φ'.

The answer tokens are the value tokens ("36"); ``answer_anchor="span"`` uses the whole span
("Answer: 36"). A row whose value is empty falls back to the whole span; a row with no reasoning
or no answer span gets saliency 0 and costs no forward, and so does a row the caller does not want
(``SignalContext.rows``: the trainer leaves out the rows with A_i = 0, whose credit is 0 whatever their saliency).

OAR-G (``INPUT_GRAD_SALIENCY``) [SRC; docs/credit/oar.md#oar-g-input-gradient-saliency]: p_0 from a clean no-grad \
forward; a noisy forward on
``inputs_embeds`` with N(0, σ²) noise (σ = option ``saliency_noise``, 1e-3) on the reasoning
embeddings only; J = KL(p_0 ‖ p_noisy) (φ_0 − φ_noisy for answer_joint); s_t = |⟨∂J/∂e_t, e_t⟩|.
The backward is ``torch.autograd.grad(J, embeds)`` with every parameter temporarily set to
``requires_grad=False`` (weight-gradient GEMMs skipped, no ``.grad`` created; flags restored
exactly). Sequences run ``micro_batch_size`` at a time (J is a sum of independent per-sequence
terms), the reference code runs one at a time. Noise is deterministic: row i's noise comes from a
``torch.Generator`` seeded with (option ``seed``, the row's global index: option ``first_row`` + i) and covers its
reasoning tokens in order, so it does not depend on padding, micro-batching, the batch's T or the number of
processes [PROPOSED].

OAR-P (``PERTURBATION_SALIENCY``): gearlab.signals.perturbation (counterfactual masking; it uses the
outcome statistic, targets and reasoning span defined here).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gearlab.core.logprobs import position_ids_from_mask
from gearlab.core.sdpa import differentiable_attention
from gearlab.signals.registry import Signal, SignalContext, register_signal
from gearlab.signals.spans import response_segments

__all__ = [
    "PFINAL_MODES",
    "ANCHORS",
    "input_grad_saliency",
    "reasoning_noise",
]

PFINAL_MODES = ("last", "answer_mean", "answer_joint")
ANCHORS = ("value", "span")


# --------------------------------------------------------------------------------------------
# shared pieces
# --------------------------------------------------------------------------------------------
@dataclass
class _Plan:
    """Per-row targets of p_final, over response positions."""

    reasoning: Tensor  # [B, T] bool
    targets: list[list[int]]  # response indices of the answer tokens whose predictions define p_final
    valid: list[bool]  # row has reasoning and a target


def _options(ctx: SignalContext) -> tuple[str, str]:
    mode = ctx.options.get("pfinal_mode", "last")
    anchor = ctx.options.get("answer_anchor", "value")
    if mode not in PFINAL_MODES:
        raise ValueError(f"pfinal_mode must be one of {PFINAL_MODES}, got {mode!r}")
    if anchor not in ANCHORS:
        raise ValueError(f"answer_anchor must be one of {ANCHORS}, got {anchor!r}")
    return mode, anchor


def _plan(ctx: SignalContext, mode: str, anchor: str) -> _Plan:
    b = ctx.batch
    seg = response_segments(ctx.tokenizer, b.response_ids, b.response_mask)
    tgt = seg.value if anchor == "value" else seg.answer
    reasoning = seg.reasoning.cpu()
    targets, valid = [], []
    for i in range(b.batch_size):
        idx = tgt[i].nonzero().flatten().tolist() or seg.answer[i].nonzero().flatten().tolist()
        if mode == "last":
            idx = idx[:1]
        ok = bool(reasoning[i].any()) and bool(idx)
        targets.append(idx if ok else [])
        valid.append(ok)
    return _Plan(reasoning, targets, valid)


def _base(model: nn.Module) -> nn.Module:
    return getattr(model, model.base_model_prefix)


def _last_hidden(model: nn.Module, use_cache: bool = False, **kw) -> Tensor:
    """Last hidden states [n, L, H] of the decoder (no LM head); ``kw`` may pass a KV cache to fill or read."""
    out = _base(model)(**kw, use_cache=use_cache)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


class _Outcome:
    """The p_final statistic of a set of sequences: log p [n, V] ("last", "answer_mean") or φ [n]."""

    def __init__(self, mode: str, head: nn.Module, temperature: float) -> None:
        self.mode, self.head, self.temperature = mode, head, temperature

    def __call__(self, hidden: Tensor, pos: Tensor, tok: Tensor, valid: Tensor) -> Tensor:
        """hidden [n, L, H]; pos/tok/valid [n, K]: positions predicting the answer tokens, the tokens, slot mask."""
        Hd = hidden.shape[-1]
        h = hidden.gather(1, pos[..., None].expand(-1, -1, Hd))  # [n, K, H]
        logits = self.head(h)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / self.temperature  # [n, K, V]
        # float64 from here on: the effects are small differences of log-probs (KL ~ 1e-6 is common)
        w = valid.double()
        cnt = w.sum(-1).clamp(min=1.0)
        if self.mode == "last":
            return F.log_softmax(logits[:, 0].double(), dim=-1)
        if self.mode == "answer_mean":
            return F.log_softmax((logits.double() * w[..., None]).sum(1) / cnt[:, None], dim=-1)
        lp = F.log_softmax(logits.double(), dim=-1).gather(-1, tok[..., None]).squeeze(-1)  # [n, K]
        return (lp * w).sum(-1) / cnt  # φ, mean log-likelihood

    def effect(self, clean: Tensor, other: Tensor) -> Tensor:
        """KL(p_clean ‖ p_other) per row, or φ_clean − φ_other."""
        if self.mode == "answer_joint":
            return clean - other
        return (clean.exp() * (clean - other)).sum(-1)


def _target_tensors(plan: _Plan, rows: list[int], offsets: list[int], device) -> tuple[Tensor, Tensor, Tensor]:
    """[n, K] positions (in each row's sequence coordinates: offset + response index − 1), token slots, mask."""
    K = max(len(plan.targets[i]) for i in rows)
    pos = torch.zeros(len(rows), K, dtype=torch.long)
    valid = torch.zeros(len(rows), K, dtype=torch.bool)
    for r, (i, off) in enumerate(zip(rows, offsets)):
        t = plan.targets[i]
        pos[r, : len(t)] = torch.tensor(t) + off - 1
        valid[r, : len(t)] = True
    return pos.to(device), valid.to(device), K


# --------------------------------------------------------------------------------------------
# OAR-G
# --------------------------------------------------------------------------------------------
def reasoning_noise(seed: int, row: int, n: int, hidden_size: int, sigma: float) -> Tensor:
    """The N(0, σ²) noise [n, H] (float32, CPU) added to the n reasoning embeddings of batch row ``row``."""
    g = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(row)) % (2**63 - 1))
    return torch.randn(n, hidden_size, generator=g) * sigma


@contextmanager
def _input_grads_only(model: nn.Module) -> Iterator[None]:
    """Every parameter frozen for the duration; flags restored exactly; fails if a .grad appeared. Attention runs
    without cuDNN's SDPA backend, whose backward is wrong on some masked inputs (gearlab.core.sdpa)."""
    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    had_grad = [p.grad is not None for p in params]
    try:
        for p in params:
            p.requires_grad_(False)
        with differentiable_attention():
            yield
    finally:
        for p, f in zip(params, flags):
            p.requires_grad_(f)
    new = [i for i, (p, h) in enumerate(zip(params, had_grad)) if p.grad is not None and not h]
    if new:
        raise RuntimeError(f"input-gradient saliency created .grad on {len(new)} parameter(s)")


@contextmanager
def _layer_checkpointing(model: nn.Module) -> Iterator[bool]:
    """Recompute each decoder layer in the backward instead of storing its activations (HF gradient
    checkpointing), so the input-gradient pass of a long response costs about one layer of activations.

    HF only checkpoints in training mode, so the model is switched to train() for the duration — done
    only when that changes nothing numerically (no dropout anywhere); otherwise this is a no-op.
    """
    cfg = getattr(model, "config", None)
    dropout = any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()) or any(
        float(getattr(cfg, k, 0.0) or 0.0) > 0 for k in (
            "attention_dropout", "hidden_dropout", "dropout", "resid_pdrop"
        ))
    if dropout or not getattr(model, "supports_gradient_checkpointing", False):
        yield False
        return
    was_on, was_training = bool(getattr(model, "is_gradient_checkpointing", False)), model.training
    if not was_on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    try:
        yield True
    finally:
        if not was_on:
            model.gradient_checkpointing_disable()
        model.train(was_training)


@register_signal(Signal.INPUT_GRAD_SALIENCY, fake="nonneg")
def input_grad_saliency(ctx: SignalContext) -> Tensor:
    """OAR-G saliency [B, T] float32 (see the module docstring)."""
    mode, anchor = _options(ctx)
    sigma = float(ctx.options.get("saliency_noise", 1e-3))
    seed = int(ctx.options.get("seed", 0))
    first = int(ctx.options.get("first_row", 0))  # this rank's first global row: a row's noise is its global row's
    b, model = ctx.batch, ctx.model
    plan = _plan(ctx, mode, anchor)
    B, T = b.response_ids.shape
    P = b.prompt_ids.shape[1]
    out = torch.zeros(B, T, dtype=torch.float32, device=b.response_ids.device)
    rows_all = [i for i in range(B) if plan.valid[i] and ctx.wanted(i)]
    if not rows_all:
        return out
    emb_layer = model.get_input_embeddings()
    outcome = _Outcome(mode, model.get_output_embeddings(), ctx.temperature)
    ids_all, mask_all = b.input_ids(), b.full_attention_mask()
    mbs = max(1, int(ctx.micro_batch_size))
    with _input_grads_only(model), torch.enable_grad():
        for s in range(0, len(rows_all), mbs):
            rows = rows_all[s : s + mbs]
            L = P + max(plan.targets[i][-1] for i in rows)  # causal: later positions cannot matter
            idx = torch.tensor(rows, device=ids_all.device)
            ids, mask = ids_all[idx, :L], mask_all[idx, :L]
            pos_ids = position_ids_from_mask(mask)
            tpos, tvalid, _ = _target_tensors(plan, rows, [P] * len(rows), ids.device)
            ttok = torch.zeros_like(tpos)
            for r, i in enumerate(rows):
                ttok[r, : len(plan.targets[i])] = b.response_ids[i, plan.targets[i]]
            with torch.no_grad():
                e = emb_layer(ids).detach()
                clean = outcome(_last_hidden(model, inputs_embeds=e, attention_mask=mask, position_ids=pos_ids),
                                tpos, ttok, tvalid)
            noise = torch.zeros_like(e)
            reason = plan.reasoning[rows][:, : L - P].to(e.device)
            for r, i in enumerate(rows):
                rpos = reason[r].nonzero().flatten()
                noise[r, P + rpos] = reasoning_noise(seed, first + i, rpos.numel(), e.shape[-1], sigma).to(e)
            x = e.clone().requires_grad_(True)
            with _layer_checkpointing(model):
                noisy = outcome(_last_hidden(model, inputs_embeds=x + noise, attention_mask=mask, position_ids=pos_ids),
                                tpos, ttok, tvalid)
                J = outcome.effect(clean, noisy).sum()  # independent per-sequence terms
                (g,) = torch.autograd.grad(J, x)
            acc = torch.promote_types(e.dtype, torch.float32)  # at least fp32 for the dot product
            sal = (g.to(acc) * e.to(acc)).sum(-1).abs()[:, P:L].float()  # [n, L-P]
            out[idx, : L - P] = sal * reason.float()
    return out
