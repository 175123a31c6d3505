"""OAR-P's counterfactual-masking saliency, ``PERTURBATION_SALIENCY`` (docs/credit/oar.md#oar-p-counterfactual-masking).

The outcome statistic p_final, the targets and the reasoning span are shared with OAR-G
(gearlab.signals.saliency, whose docstring defines the ``pfinal_mode`` / ``answer_anchor`` options).

[SRC] For each reasoning position j a copy of the sequence with y_j replaced by the pad token;
s_j = KL(p_final ‖ p_final^(−j)) (φ − φ^(−j) for answer_joint, clamped at 0 [PROPOSED]: a token whose
removal makes the answer MORE likely gets no importance). The replaced position stays attended
(attention mask 1, positions unchanged): the source inserts the pad id into the token list and runs it
as an ordinary token [INF]. Each sequence is cut after the last position p_final needs, and its own left
padding is removed. Long reasoning [PROPOSED]: only every ``stride``-th reasoning token (and the last
one) is perturbed, stride = max(``perturb_stride``, ceil(n / ``perturb_max_positions``)); skipped
tokens get values linearly interpolated, over the reasoning-token index, between their computed
neighbours.

Two ways to score the copies, same values (up to float rounding):

* ``perturb_kv_share=True``: a copy perturbed at sequence position p equals the clean
  sequence before p, so its keys / values there are the clean ones. The clean sequences run
  ``micro_batch_size`` rows at a time with a KV cache; then each row's copies, ``micro_batch_size`` at
  a time (copies of one row, in position order), run only their suffix p..L−1, right-padded to the
  longest suffix of the chunk, on top of a read-only view of the row's clean cache cut at C = the
  chunk's largest p. Copy k's cache positions p_k..C−1 (clean tokens it recomputes itself) are masked
  out of the attention; its suffix tokens keep their true positions p_k + j (RoPE sees the true
  distances), and the causal mask over cache index C + j lets each of them see the prefix 0..p_k−1
  and the suffix up to itself. Right padding is attended (it is after every token that is read, so
  causally invisible; attending it keeps every query row non-empty). The cached prefix is never
  copied: each layer concatenates the view with the suffix's keys / values and drops the result
  after its attention (``_PrefixLayer``), so the extra memory is the clean cache of one micro-batch
  of rows.
* ``perturb_kv_share=False`` (default: faster on a GPU, see docs/credit/oar.md#cost), or a model the shared path \
cannot take (``_cache_keyword`` returns None:
  no per-layer ``DynamicLayer`` in the installed transformers, an FSDP1 wrapper, an attention other
  than eager / sdpa, a layer that is not full attention, no cache argument on the decoder; or a clean
  cache that is not one ``DynamicLayer`` per layer): every copy is a full forward, copies of all rows
  batched ``micro_batch_size`` at a time, each left-padded per chunk.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gearlab.core.logprobs import position_ids_from_mask
from gearlab.parallel.distributed import is_fsdp1
from gearlab.signals.registry import Signal, SignalContext, register_signal
from gearlab.signals.saliency import _base, _last_hidden, _options, _Outcome, _Plan, _plan, _target_tensors

try:  # transformers with per-layer cache objects (5.x): the KV-sharing path
    from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
except ImportError:  # older transformers: full recompute only
    Cache = DynamicCache = DynamicLayer = None  # type: ignore[assignment,misc]

__all__ = ["perturbation_saliency", "perturb_indices", "interpolate_skipped"]


def perturb_indices(n: int, stride: int = 1, max_positions: int = 64) -> list[int]:
    """Reasoning-token indices (0..n−1) to perturb: every ``stride``-th with stride raised to
    ceil(n / max_positions) (``max_positions`` ≤ 0: no cap), always including the last one."""
    if n <= 0:
        return []
    st = max(1, int(stride))
    if max_positions and max_positions > 0:
        st = max(st, math.ceil(n / max_positions))
    idx = list(range(0, n, st))
    if idx[-1] != n - 1:
        idx.append(n - 1)
    return idx


def interpolate_skipped(computed_idx: list[int], values: Tensor, n: int) -> Tensor:
    """Linear interpolation over 0..n−1 of ``values`` known at sorted ``computed_idx`` (which include 0 and n−1)."""
    xs = torch.tensor(computed_idx, dtype=torch.float64)
    ys = values.to(torch.float64)
    if len(computed_idx) == n:
        return values.float()
    k = torch.arange(n, dtype=torch.float64)
    hi = torch.searchsorted(xs, k).clamp(1, len(xs) - 1)
    lo = hi - 1
    t = (k - xs[lo]) / (xs[hi] - xs[lo])
    return (ys[lo] + t * (ys[hi] - ys[lo])).float()


@dataclass
class _Rows:
    """The scored rows, each as an unpadded sequence cut after the last position p_final needs."""

    plan: _Plan
    response_ids: Tensor  # [B, T] the batch's responses (target tokens)
    seqs: dict[int, Tensor]  # row → [L_i] prompt (unpadded) ⊕ response[: last target]
    offsets: dict[int, int]  # row → prompt length: response index t sits at sequence index offset + t
    starts: dict[int, list[int]]  # row → ascending sequence indices of the perturbed positions

    def targets(self, rows: list[int], shifts: list[int], device) -> tuple[Tensor, Tensor, Tensor]:
        """[n, K] positions predicting the answer tokens (sequence index + shift), the tokens, slot mask,
        for the entries ``rows`` (a row may repeat: one entry per copy)."""
        pos, valid, _ = _target_tensors(self.plan, rows, [self.offsets[i] + s for i, s in zip(rows, shifts)], device)
        tok = torch.zeros_like(pos)
        for r, i in enumerate(rows):
            t = self.plan.targets[i]
            tok[r, : len(t)] = self.response_ids[i, t]
        return pos, tok, valid


def _left_padded(seqs: list[Tensor], pad_id: int, device) -> tuple[Tensor, Tensor, list[int]]:
    """``seqs`` left-padded: ids [n, L] long, attention mask [n, L] long, each row's number of pads."""
    L = max(s.numel() for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros(len(seqs), L, dtype=torch.long, device=device)
    lead = [L - s.numel() for s in seqs]
    for r, (s, p) in enumerate(zip(seqs, lead)):
        ids[r, p:] = s
        mask[r, p:] = 1
    return ids, mask, lead


# --------------------------------------------------------------------------------------------
# full recompute: one forward per copy
# --------------------------------------------------------------------------------------------
def _effects_full(model: nn.Module, R: _Rows, outcome: _Outcome, mbs: int, pad_id: int, device) -> dict[int, Tensor]:
    """Row → effects [n_i] (float64) of its perturbed copies, in ``R.starts`` order; clean sequences and
    copies of all rows batched ``mbs`` at a time (clean ones first), each chunk left-padded."""
    jobs = [(i, -1) for i in R.seqs] + [(i, p) for i in R.seqs for p in R.starts[i]]  # (row, position or −1 = clean)
    clean: dict[int, Tensor] = {}
    effects: dict[int, list[Tensor]] = {i: [] for i in R.seqs}
    for s in range(0, len(jobs), mbs):
        chunk = jobs[s : s + mbs]
        seqs = []
        for i, p in chunk:
            sq = R.seqs[i].clone()
            if p >= 0:
                sq[p] = pad_id  # still attended [INF]
            seqs.append(sq)
        ids, mask, lead = _left_padded(seqs, pad_id, device)
        rows = [i for i, _ in chunk]
        hidden = _last_hidden(model, input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask))
        stat = outcome(hidden, *R.targets(rows, lead, device))
        for r, (i, p) in enumerate(chunk):
            if p < 0:
                clean[i] = stat[r]
            else:
                effects[i].append(outcome.effect(clean[i], stat[r]))
    return {i: torch.stack(v) for i, v in effects.items()}


# --------------------------------------------------------------------------------------------
# KV sharing: the clean prefix's keys / values computed once per row
# --------------------------------------------------------------------------------------------
if DynamicLayer is not None:

    class _PrefixLayer(DynamicLayer):  # type: ignore[misc,valid-type]
        """A read-only cache layer holding a prefix [n, h, C, d] (a view of the clean cache): ``update``
        returns prefix ⊕ new along the sequence and keeps nothing, so the prefix is never copied into
        storage and the concatenation is freed after the layer's attention."""

        def __init__(self, keys: Tensor, values: Tensor) -> None:
            super().__init__()
            self.keys, self.values, self.device, self.is_initialized = keys, values, keys.device, True

        def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
            return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


def _cache_keyword(model: nn.Module) -> str | None:
    """The keyword under which the decoder takes a KV cache (``cache``; ``past_key_values`` in earlier
    transformers), or None where the shared path is not used (see the module docstring)."""
    if DynamicLayer is None or is_fsdp1(model):
        return None
    cfg = getattr(model, "config", None)
    if getattr(cfg, "_attn_implementation", None) not in ("eager", "sdpa"):
        return None  # flash / flex attention: the masked gap in the cache is untested there
    types = getattr(cfg, "layer_types", None)
    if (types and any(t != "full_attention" for t in types)) or (not types and getattr(cfg, "sliding_window", None)
                                                                  and getattr(cfg, "use_sliding_window", True)):
        return None  # sliding-window / linear layers keep a different cache than positions 0..L−1
    try:
        params = inspect.signature(_base(model).forward).parameters
        if "layers" not in inspect.signature(Cache).parameters:  # a Cache built from given layer objects
            return None
    except (TypeError, ValueError):
        return None
    return next((k for k in ("cache", "past_key_values") if k in params), None)


def _clean_kv(cache, n: int, L: int) -> list[tuple[Tensor, Tensor]] | None:
    """Per layer (keys, values) [n, h, L, d] of a filled clean cache; None unless it is one plain
    ``DynamicLayer`` per layer holding all L positions."""
    layers = getattr(cache, "layers", None)
    if not layers or any(type(x) is not DynamicLayer or x.keys is None for x in layers):
        return None
    if any(
        x.keys.dim() != 4 or x.keys.shape[0] != n or x.keys.shape[-2] != L or x.values.shape[-2] != L for x in layers
    ):
        return None
    return [(x.keys, x.values) for x in layers]


def _effects_shared(model: nn.Module, keyword: str, R: _Rows, outcome: _Outcome, mbs: int, pad_id: int,
                    device) -> dict[int, Tensor] | None:
    """Row → effects [n_i] (float64), as ``_effects_full``, with each copy's forward over its suffix only
    (see the module docstring); None if the clean cache turns out unusable (the caller recomputes)."""
    rows_all = list(R.seqs)
    effects: dict[int, Tensor] = {}
    for s in range(0, len(rows_all), mbs):
        crow = rows_all[s : s + mbs]
        ids, mask, lead = _left_padded([R.seqs[i] for i in crow], pad_id, device)
        cache = DynamicCache()
        hidden = _last_hidden(model, use_cache=True, **{keyword: cache}, input_ids=ids, attention_mask=mask,
                             position_ids=position_ids_from_mask(mask))
        clean = outcome(hidden, *R.targets(crow, lead, device))  # [n, V] log p, or φ [n]
        kv = _clean_kv(cache, len(crow), ids.shape[1])
        del cache, hidden
        if kv is None:
            return None
        for r, i in enumerate(crow):
            seq, L, starts = R.seqs[i].to(device), R.seqs[i].numel(), R.starts[i]
            vals = []
            for c in range(0, len(starts), mbs):
                part = starts[c : c + mbs]  # ascending
                n, C, S = len(part), part[-1], L - part[0]
                p = torch.tensor(part, device=device)[:, None]  # [n, 1]
                src = p + torch.arange(S, device=device)  # [n, S] sequence index of each suffix slot
                ids_s = torch.where(src < L, seq[src.clamp(max=L - 1)], pad_id)  # right-padded suffixes
                ids_s[:, 0] = pad_id  # the perturbation, still attended [INF]
                # cache index < p_k: the shared clean prefix; p_k..C−1: masked; C + j: suffix slot j (padding included)
                attn = torch.cat([torch.arange(C, device=device)[None] < p,
                                  torch.ones(n, S, dtype=torch.bool, device=device)], dim=1).long()
                a = lead[r]
                prefix = Cache(layers=[_PrefixLayer(k[r : r + 1, :, a : a + C].expand(n, -1, -1, -1),
                                                    v[r : r + 1, :, a : a + C].expand(n, -1, -1, -1)) for k, v in kv])
                h = _last_hidden(model, use_cache=True, **{keyword: prefix}, input_ids=ids_s, attention_mask=attn,
                                 position_ids=src.clamp(max=L - 1))
                stat = outcome(h, *R.targets([i] * n, [-q for q in part], device))
                vals.append(outcome.effect(clean[r], stat))
            effects[i] = torch.cat(vals)
    return effects


@register_signal(Signal.PERTURBATION_SALIENCY, fake="nonneg")
def perturbation_saliency(ctx: SignalContext) -> Tensor:
    """OAR-P saliency [B, T] float32 (see the module docstring)."""
    mode, anchor = _options(ctx)
    stride = int(ctx.options.get("perturb_stride", 1))
    max_pos = int(ctx.options.get("perturb_max_positions", 64) or 0)
    share = bool(ctx.options.get("perturb_kv_share", False))
    b, model, tok = ctx.batch, ctx.model, ctx.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    plan = _plan(ctx, mode, anchor)
    B, T = b.response_ids.shape
    dev = b.response_ids.device
    out = torch.zeros(B, T, dtype=torch.float32, device=dev)
    outcome = _Outcome(mode, model.get_output_embeddings(), ctx.temperature)

    R = _Rows(plan, b.response_ids, {}, {}, {})
    rpos: dict[int, Tensor] = {}  # response indices of the reasoning tokens
    chosen: dict[int, list[int]] = {}  # reasoning-token indices perturbed
    for i in range(B):
        if not (plan.valid[i] and ctx.wanted(i)):
            continue
        prompt = b.prompt_ids[i][b.prompt_mask[i].bool()]
        R.seqs[i] = torch.cat([prompt, b.response_ids[i, : plan.targets[i][-1]]])
        R.offsets[i] = prompt.numel()
        rpos[i] = plan.reasoning[i].nonzero().flatten()
        chosen[i] = perturb_indices(rpos[i].numel(), stride, max_pos)
        R.starts[i] = [R.offsets[i] + int(rpos[i][k]) for k in chosen[i]]
    if not R.seqs:
        return out
    mbs = max(1, int(ctx.micro_batch_size))
    keyword = _cache_keyword(model) if share else None
    with torch.no_grad():
        effects = _effects_shared(model, keyword, R, outcome, mbs, pad_id, dev) if keyword else None
        if effects is None:
            effects = _effects_full(model, R, outcome, mbs, pad_id, dev)
    for i in R.seqs:
        vals = effects[i].float().clamp(min=0.0)
        full = interpolate_skipped(chosen[i], vals.cpu(), rpos[i].numel())
        out[i, rpos[i].to(dev)] = full.to(dev)
    return out
