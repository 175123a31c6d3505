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

``fused=True`` runs q/k/v as one GEMM and gate/up as one GEMM per layer, over concatenated copies of those weights in
the compute dtype (``FusedWeights``: extra memory = those projections' parameters at 2 bytes each in bf16).
``refresh_fused`` rewrites the copies in place from the model's weights (the fast engine calls it at every call, so
optimizer steps are seen and captured graphs, which point at the copies, stay valid).

``attention="flex"`` runs a decode step's attention with compiled ``flex_attention`` instead of SDPA (on CUDA its
split-K decode kernel; ``gearlab.rollout.attention``); ``attention="split"`` with gearlab's own split-K Triton kernel
(deterministic; ``gearlab.rollout.split_decode``); prefill stays SDPA.

Simplifications: attention is PyTorch's ``scaled_dot_product_attention`` (or, for decode steps with
``attention="flex"``, ``flex_attention`` with the mask as a score modification) over the first ``L`` cache
positions (a bucket length fixed per captured graph, ≥ the filled length) with a boolean mask, without cuDNN's kernels
(``attention="sdpa"``: on CUDA they gave different tokens in different processes; ``"sdpa_auto"`` keeps SDPA's own
choice); the numerics equal HF's SDPA path to float tolerance (tested: greedy tokens equal
``generate``'s, log-probs equal the trainer's; the flex step's logits equal the SDPA step's).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gearlab.core.sdpa import reproducible_attention
from gearlab.parallel.compiling import deterministic_compile
from gearlab.rollout.attention import ATTENTION, FlexDecode
from gearlab.rollout.split_decode import SplitDecode

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


def _norm(module: nn.Module, x: Tensor) -> Tensor:
    """A norm's forward without the module's hooks: under FSDP2 with bf16-mixed a layer's norms are a float32 unit of
    their own (gearlab.parallel.distributed.shard_fsdp2), whose hooks would treat it as a root before any forward of
    the model and free the weights that the caller has gathered for the whole decode."""
    return module.forward(x)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attn_inputs(layer: nn.Module, h: Tensor, cos: Tensor, sin: Tensor, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """A layer's attention inputs: hidden [B, S, H_model] → q [B, H, S, D], k and v [B, H_kv, S, D], rotated (cos,
    sin [B, 1, S, D]). It calls the layer's own modules; compiled, one graph serves every layer (torch.compile
    lifts module parameters to graph inputs), and its shapes do not depend on the cache length."""
    B, S, _ = h.shape
    a = layer.self_attn
    x = _norm(layer.input_layernorm, h)
    q = a.q_proj(x).view(B, S, -1, head_dim)
    k = a.k_proj(x).view(B, S, -1, head_dim)
    v = a.v_proj(x).view(B, S, -1, head_dim).transpose(1, 2)
    if hasattr(a, "q_norm"):  # Qwen3: per-head RMSNorm of queries and keys before the rotation
        q, k = _norm(a.q_norm, q), _norm(a.k_norm, k)
    return _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin), v


def attn_output_and_mlp(layer: nn.Module, h: Tensor, o: Tensor) -> Tensor:
    """The rest of a layer after attention: residual stream h [B, S, H_model] and attention output o [B, S, H·D]
    → the layer's output [B, S, H_model] (o_proj, residual, post-attention norm, MLP, residual)."""
    h = h + layer.self_attn.o_proj(o)
    return h + layer.mlp(_norm(layer.post_attention_layernorm, h))


def attn_inputs_fused(layer: nn.Module, w: Tensor, b: Tensor | None, h: Tensor, cos: Tensor, sin: Tensor,
                      head_dim: int, sizes: tuple[int, int, int]) -> tuple[Tensor, Tensor, Tensor]:
    """``attn_inputs`` with q/k/v as one GEMM: ``w`` [(H + 2·H_kv)·D, H_model] (``b`` its bias or None), ``sizes`` =
    the widths of q, k and v in it."""
    B, S, _ = h.shape
    a = layer.self_attn
    q, k, v = F.linear(_norm(layer.input_layernorm, h), w, b).split(sizes, dim=-1)
    q, k = q.reshape(B, S, -1, head_dim), k.reshape(B, S, -1, head_dim)
    v = v.reshape(B, S, -1, head_dim).transpose(1, 2)
    if hasattr(a, "q_norm"):
        q, k = _norm(a.q_norm, q), _norm(a.k_norm, k)
    return _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin), v


def attn_output_and_mlp_fused(layer: nn.Module, w: Tensor, b: Tensor | None, h: Tensor, o: Tensor) -> Tensor:
    """``attn_output_and_mlp`` with the MLP's gate and up projections as one GEMM: ``w`` [2·I, H_model] (gate rows
    first; ``b`` its bias or None)."""
    h = h + layer.self_attn.o_proj(o)
    mlp = layer.mlp
    gate, up = F.linear(_norm(layer.post_attention_layernorm, h), w, b).chunk(2, dim=-1)
    return h + mlp.down_proj(mlp.act_fn(gate) * up)


def _gated_mlp(layer: nn.Module) -> bool:
    """Whether the layer's MLP is down(act(gate(x)) · up(x)) (Llama, Qwen, Mistral), so gate/up can be fused."""
    return all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def _joined(mods: list[nn.Module], attr: str) -> list[Tensor] | None:
    parts = [getattr(m, attr, None) for m in mods]
    if all(p is None for p in parts):
        return None
    return [p if p is not None else torch.zeros(m.weight.shape[0], device=m.weight.device, dtype=m.weight.dtype)
            for p, m in zip(parts, mods)]


@dataclass
class FusedWeights:
    """Per layer: q/k/v as one weight [(H + 2·H_kv)·D, H_model] and gate/up as one [2·I, H_model] (gate first), with
    their biases where the model has them, in the compute dtype. ``gate_up[i]`` is None for an MLP of another form."""
    qkv: list[Tensor]
    qkv_bias: list[Tensor | None]
    gate_up: list[Tensor | None]
    gate_up_bias: list[Tensor | None]
    sizes: tuple[int, int, int]  # the widths of q, k and v in a qkv weight

    @staticmethod
    def groups(layer: nn.Module) -> tuple[list[nn.Module], list[nn.Module] | None]:
        a = layer.self_attn
        return [a.q_proj, a.k_proj, a.v_proj], ([layer.mlp.gate_proj, layer.mlp.up_proj] if _gated_mlp(layer) else None)

    @classmethod
    def empty(cls, layers: list[nn.Module], dtype: torch.dtype) -> "FusedWeights":
        def new(mods: list[nn.Module] | None, attr: str = "weight") -> Tensor | None:
            if mods is None or (attr == "bias" and _joined(mods, "bias") is None):
                return None
            w = mods[0].weight
            rows = sum(m.weight.shape[0] for m in mods)
            return torch.empty((rows, w.shape[1]) if attr == "weight" else (rows,), device=w.device, dtype=dtype)

        g = [cls.groups(layer) for layer in layers]
        qkv_mods = g[0][0]
        return cls([new(a) for a, _ in g], [new(a, "bias") for a, _ in g], [new(m) for _, m in g],
                   [new(m, "bias") for _, m in g], tuple(m.weight.shape[0] for m in qkv_mods))

    @torch.no_grad()
    def refresh(self, layers: list[nn.Module]) -> None:
        """Copy the model's current weights into the fused buffers, in place."""
        for i, layer in enumerate(layers):
            attn, mlp = self.groups(layer)
            for buf, mods, attr in ((self.qkv[i], attn, "weight"), (self.qkv_bias[i], attn, "bias"),
                                    (self.gate_up[i], mlp, "weight"), (self.gate_up_bias[i], mlp, "bias")):
                if buf is None:
                    continue
                parts = [m.weight for m in mods] if attr == "weight" else _joined(mods, "bias")
                if buf.dtype == parts[0].dtype:
                    torch.cat(parts, dim=0, out=buf)
                else:  # e.g. fp32 master weights into bf16 copies
                    buf.copy_(torch.cat(parts, dim=0))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in (self.qkv, self.qkv_bias, self.gate_up, self.gate_up_bias)
                   for t in ts if t is not None)


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

    def __init__(self, model: nn.Module, compile: bool = False, fused: bool = False, attention: str = "sdpa") -> None:
        reason = supports(model)
        if reason:
            raise ValueError(f"rollout.engine=fast: {reason}")
        if attention not in ATTENTION:
            raise ValueError(f"rollout.fast.attention: {attention!r} is not one of {', '.join(ATTENTION)}")
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
        self._attn_in_f, self._attn_out_f = attn_inputs_fused, attn_output_and_mlp_fused
        self.compiled = compile
        self.fused = fused
        self.fw: FusedWeights | None = None  # made and refreshed by refresh_fused
        self.attention = attention
        self.flex = FlexDecode() if attention == "flex" else None  # decode steps' attention (gearlab.rollout.attention)
        self.split = SplitDecode() if attention == "split" else None  # (gearlab.rollout.split_decode)
        if compile:
            # the two pieces around attention, for decode steps: their shapes are the same at every step and every
            # cache length, so each compiles once for the first batch size (and once more, with a dynamic batch
            # size, when another comes: multi-turn rollouts and evaluation vary it), and the elementwise work
            # between the matmuls (RMSNorm's fp32 round trip, rotary, SiLU·mul, residual adds) fuses; attention and
            # the cache writes stay eager, one kernel each
            self._attn_in = deterministic_compile(attn_inputs)
            self._attn_out = deterministic_compile(attn_output_and_mlp)
            self._attn_in_f = deterministic_compile(attn_inputs_fused)
            self._attn_out_f = deterministic_compile(attn_output_and_mlp_fused)

    def refresh_fused(self) -> None:
        """With ``fused``: (re)write the fused q/k/v and gate/up copies from the model's weights, in place (made at
        the first call, and again if the compute dtype changed). Call it before decoding with new weights."""
        if not self.fused:
            return
        dt = self.compute_dtype()
        if self.fw is None or self.fw.qkv[0].dtype != dt:
            self.fw = FusedWeights.empty(self.layers, dt)
        self.fw.refresh(self.layers)

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
        if self.fused and self.fw is None:
            self.refresh_fused()
        fw = self.fw if self.fused else None
        if fw is not None:
            attn_in_f, attn_out_f = (self._attn_in_f, self._attn_out_f) if S == 1 else (attn_inputs_fused,
                                                                                      attn_output_and_mlp_fused)
        h = self.base.embed_tokens(ids)
        cos, sin = self.base.rotary_emb(h, pos)
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, S, D]: broadcast over heads
        for i, layer in enumerate(self.layers):
            if fw is not None:
                q, k, v = attn_in_f(layer, fw.qkv[i], fw.qkv_bias[i], h, cos, sin, self.head_dim, fw.sizes)
            else:
                q, k, v = attn_in(layer, h, cos, sin, self.head_dim)
            kc, vc = cache.keys[i], cache.values[i]
            kc.index_copy_(2, write_at, k.to(kc.dtype))
            vc.index_copy_(2, write_at, v.to(vc.dtype))
            o = self._attend(q, kc, vc, length, mask)
            o = o.transpose(1, 2).reshape(B, S, -1)
            if fw is not None and fw.gate_up[i] is not None:
                h = attn_out_f(layer, fw.gate_up[i], fw.gate_up_bias[i], h, o)
            else:
                h = attn_out(layer, h, o)
        return self.base.norm(h[:, -1])

    def _attend(self, q: Tensor, kc: Tensor, vc: Tensor, length: int, mask: Tensor) -> Tensor:
        """Attention of q [B, H, S, D] over the first ``length`` positions of one layer's cache under ``mask``
        [B, 1, S, length] → [B, H, S, D]."""
        B, H, S, _ = q.shape
        step = self.flex or self.split  # a decode step's own kernel, if one was chosen
        if S == 1 and step is not None:
            return step(q, kc[:, :, :length], vc[:, :, :length], mask[:, 0, 0].expand(B, length), self.scaling)
        k, v = kc[:, :, :length], vc[:, :, :length]
        auto = self.attention == "sdpa_auto"  # SDPA's own backend choice (cuDNN's grouped-query path on Hopper)
        with contextlib.nullcontext() if auto else reproducible_attention():  # no cuDNN: the same bits everywhere
            if S == 1 and H != self.n_kv and not (auto and kc.is_cuda):
                return self._grouped(q, k, v, mask)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling,
                                                  enable_gqa=H != self.n_kv)

    def _grouped(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """One decode position with grouped K/V heads: the query heads sharing a K/V head become that head's "query
        positions", so each K/V head is read once and no expanded copy exists (head h uses K/V head h // (H / H_kv),
        as HF), and SDPA's memory-efficient kernel, which takes no grouped heads itself, can run it."""
        B, H = q.shape[:2]
        qg = q.reshape(B, self.n_kv, H // self.n_kv, self.head_dim)
        return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=self.scaling).reshape(
            B, H, 1, self.head_dim)

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
