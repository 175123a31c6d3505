"""The forward pass of a Llama-family decoder over a static KV cache, written against the HF model's own modules.

``Decoder`` reads the modules of a loaded Hugging Face causal LM (embeddings, each layer's projections, norms and
MLP, the rotary embedding, the final norm, the head) and runs them itself, so that one decode step is a fixed
sequence of tensor operations on fixed-shape buffers: no Python-side cache objects, no mask building, no
host synchronisation — the form a CUDA graph can capture. The weights are the model's own tensors (nothing is
copied), so an optimizer step that updates them in place is seen by the next step, captured graphs included.

Supported: the architectures whose layers have ``self_attn.{q,k,v,o}_proj`` (optionally ``q_norm``/``k_norm``,
Qwen3), ``input_layernorm``, ``post_attention_layernorm`` and ``mlp``, full attention only (Qwen3, Qwen2, Llama,
SmolLM2, Mistral without a sliding window). ``supports(model)`` says whether a model qualifies; the fast engine
refuses the others with a one-line reason.

``compile=True`` compiles the two pieces of a layer around attention (``attn_inputs``, ``attn_output_and_mlp``)
for decode steps; one graph of each serves every layer and every cache length.

Simplifications: attention is PyTorch's ``scaled_dot_product_attention`` over the first ``L`` cache positions (a
bucket length fixed per captured graph, ≥ the filled length) with a boolean mask — on CUDA at decode its own
grouped-query path; the numerics equal HF's SDPA path to float tolerance (tested: greedy tokens equal
``generate``'s, log-probs equal the trainer's).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ARCH_KEYS = ("q_proj", "k_proj", "v_proj", "o_proj")


def supports(model: nn.Module) -> str | None:
    """None if ``model`` has the layout this decoder runs; else a one-line reason why not."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(base, "layers", None)
    if base is None or layers is None or not len(layers):
        return f"{type(model).__name__} has no decoder layers at .{getattr(model, 'base_model_prefix', 'model')}.layers"
    if getattr(base, "rotary_emb", None) is None or model.get_output_embeddings() is None:
        return f"{type(model).__name__} has no shared rotary embedding or no output head"
    cfg = model.config
    if any(
        t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])
    ) or getattr(cfg, "use_sliding_window", False):
        return f"{type(model).__name__} uses sliding-window attention"
    for name in ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn"):
        if not hasattr(layers[0], name):
            return f"{type(model).__name__}'s layers have no .{name}"
    if not all(hasattr(layers[0].self_attn, k) for k in ARCH_KEYS):
        return f"{type(model).__name__}'s attention has no separate q/k/v/o projections"
    return None


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attn_inputs(layer: nn.Module, h: Tensor, cos: Tensor, sin: Tensor, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """A layer's attention inputs: hidden [B, S, H_model] → q [B, H, S, D], k and v [B, H_kv, S, D], rotated (cos,
    sin [B, 1, S, D]). It calls the layer's own modules; compiled, one graph serves every layer (torch.compile
    lifts module parameters to graph inputs), and its shapes do not depend on the cache length."""
    B, S, _ = h.shape
    a = layer.self_attn
    x = layer.input_layernorm(h)
    q = a.q_proj(x).view(B, S, -1, head_dim)
    k = a.k_proj(x).view(B, S, -1, head_dim)
    v = a.v_proj(x).view(B, S, -1, head_dim).transpose(1, 2)
    if hasattr(a, "q_norm"):  # Qwen3: per-head RMSNorm of queries and keys before the rotation
        q, k = a.q_norm(q), a.k_norm(k)
    return _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin), v


def attn_output_and_mlp(layer: nn.Module, h: Tensor, o: Tensor) -> Tensor:
    """The rest of a layer after attention: residual stream h [B, S, H_model] and attention output o [B, S, H·D]
    → the layer's output [B, S, H_model] (o_proj, residual, post-attention norm, MLP, residual)."""
    h = h + layer.self_attn.o_proj(o)
    return h + layer.mlp(layer.post_attention_layernorm(h))


@dataclass
class KVCache:
    """Per-layer key and value buffers [B, H_kv, L_max, D] in the compute dtype."""
    keys: list[Tensor]
    values: list[Tensor]

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]


class Decoder:
    """Prefill and one-token decode steps of ``model`` over a ``KVCache`` (see the module docstring)."""

    def __init__(self, model: nn.Module, compile: bool = False) -> None:
        reason = supports(model)
        if reason:
            raise ValueError(f"rollout.engine=fast: {reason}")
        base = getattr(model, model.base_model_prefix)
        self.model, self.base = model, base
        self.layers = list(base.layers)
        self.head = model.get_output_embeddings()
        attn = self.layers[0].self_attn
        cfg = model.config
        self.head_dim = getattr(attn, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.scaling = getattr(attn, "scaling", self.head_dim ** -0.5)
        self._attn_in, self._attn_out = attn_inputs, attn_output_and_mlp
        self.compiled = compile
        if compile:
            # the two pieces around attention, for decode steps: their shapes are the same at every step and every
            # cache length, so each compiles once for the first batch size (and once more, with a dynamic batch
            # size, when another comes: multi-turn rollouts and evaluation vary it), and the elementwise work
            # between the matmuls (RMSNorm's fp32 round trip, rotary, SiLU·mul, residual adds) fuses; attention and
            # the cache writes stay eager, one kernel each
            self._attn_in = torch.compile(attn_inputs)
            self._attn_out = torch.compile(attn_output_and_mlp)

    def compute_dtype(self) -> torch.dtype:
        """The dtype activations and the cache take: autocast's if it is on, else the weights'."""
        dev = self.head.weight.device.type
        if torch.is_autocast_enabled(dev):
            return torch.get_autocast_dtype(dev)
        return self.head.weight.dtype

    def new_cache(self, batch: int, length: int) -> KVCache:
        dev, dt = self.head.weight.device, self.compute_dtype()
        shape = (batch, self.n_kv, length, self.head_dim)
        return KVCache([torch.zeros(shape, device=dev, dtype=dt) for _ in self.layers],
                       [torch.zeros(shape, device=dev, dtype=dt) for _ in self.layers])

    def forward(self, ids: Tensor, pos: Tensor, cache: KVCache, write_at: Tensor, length: int, mask: Tensor) -> Tensor:
        """ids, pos [B, S] (token ids, rotary positions); the S new keys/values go to cache positions
        ``write_at`` [S]; attention runs over cache positions [0, length) under ``mask`` [B, 1, S, length] (True =
        attend). Returns the final-normed hidden state of the LAST of the S positions [B, H]. A decode step (S = 1)
        goes through the compiled pieces when the decoder was built with ``compile=True``."""
        B, S = ids.shape
        attn_in, attn_out = (self._attn_in, self._attn_out) if S == 1 else (attn_inputs, attn_output_and_mlp)
        h = self.base.embed_tokens(ids)
        cos, sin = self.base.rotary_emb(h, pos)
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, S, D]: broadcast over heads
        for i, layer in enumerate(self.layers):
            q, k, v = attn_in(layer, h, cos, sin, self.head_dim)
            kc, vc = cache.keys[i], cache.values[i]
            kc.index_copy_(2, write_at, k.to(kc.dtype))
            vc.index_copy_(2, write_at, v.to(vc.dtype))
            H = q.shape[1]
            if S == 1 and H != self.n_kv and not kc.is_cuda:
                # one decode position: the query heads sharing a K/V head become that head's "query positions", so
                # each K/V head is read once and no expanded copy exists (head h uses K/V head h // (H / H_kv), as HF).
                # On CUDA, SDPA's own grouped-query path (cuDNN) is faster at decode: 54 vs 70 µs per layer on an
                # H100 at batch 128 over 128-320 cached positions (experiments/bench/results/decode_attention_h100.json)
                qg = q.reshape(B, self.n_kv, H // self.n_kv, self.head_dim)
                o = F.scaled_dot_product_attention(qg, kc[:, :, :length], vc[:, :, :length], attn_mask=mask,
                                                   scale=self.scaling).reshape(B, H, 1, self.head_dim)
            else:
                o = F.scaled_dot_product_attention(q, kc[:, :, :length], vc[:, :, :length], attn_mask=mask,
                                                   scale=self.scaling, enable_gqa=H != self.n_kv)
            h = attn_out(layer, h, o.transpose(1, 2).reshape(B, S, -1))
        return self.base.norm(h[:, -1])

    def prefill(self, ids: Tensor, mask: Tensor, cache: KVCache) -> Tensor:
        """Left-padded prompts ids/mask [B, P] into cache positions [0, P); returns the last position's logits
        [B, V] float32. Positions skip the left padding (as HF ``generate`` and the trainer number them)."""
        B, P = ids.shape
        pos = (mask.long().cumsum(-1) - 1).clamp_(min=0)
        causal = torch.ones(P, P, dtype=torch.bool, device=ids.device).tril_()
        attend = causal[None, None] & mask.bool()[:, None, None, :]
        attend |= torch.eye(P, dtype=torch.bool, device=ids.device)  # padding rows attend to themselves: no NaN
        h = self.forward(ids, pos, cache, torch.arange(P, device=ids.device), P, attend)
        return self.head(h).float()

    def logits(self, hidden: Tensor) -> Tensor:
        return self.head(hidden).float()
