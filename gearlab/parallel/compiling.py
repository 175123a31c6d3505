"""Regional ``torch.compile`` for the cache-free forwards (``trainer.compile=true``).

What is compiled: each decoder layer's ``forward`` (one code object, so the compiled graph is shared by
every layer) and the log-prob head's per-chunk statistics (``gearlab.core.logprobs``). At small hidden sizes
the update is bound by elementwise work between the matmuls — RMSNorm's fp32 round trip, rotary
embeddings, SiLU·mul, residual adds, the head's cast / logsumexp / gather — which Inductor fuses.

What is not: a layer called with a KV cache (``generate``) runs its eager forward, so decoding keeps
HF's own path (``rollout.static_cache`` compiles that separately). The layer's module, parameters and
state-dict keys are untouched (the forward is replaced on the instance, not the module wrapped), so
FSDP2's hooks stay outside the compiled region, and checkpoints, export and vLLM weight sync see the
same names. FSDP1 flattens parameters and is refused with compile (config validation).

Shapes vary per micro-batch (rows, response length): the first change of shape recompiles once with
dynamic sizes (``dynamic=None``). Other guards add variants of the same graph: grad mode (update vs log-prob
and signal passes), train/eval mode, an attention mask or none (transformers drops it when nothing is padded),
flags such as ``with_entropy``. A GEAR run with a reference copy reaches ~10 within its first iterations, over
Dynamo's default limit of 8 per function, past which it silently runs eager; the limit is raised to
``RECOMPILE_LIMIT`` (tested: 16 variants all compile; an 8-iteration CPU run compiled only in its first).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from torch import nn

from gearlab.parallel.distributed import decoder_layers

# the KV cache's keyword across transformers versions (4.x: past_key_value; 5.0–5.2x: past_key_values; later: cache)
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")
RECOMPILE_LIMIT = 64


def raise_recompile_limit() -> None:
    """Let torch.compile keep up to RECOMPILE_LIMIT graphs per function (shapes, bucket lengths) before it falls back \
to eager."""
    import torch._dynamo

    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # renamed in torch 2.6
    setattr(cfg, name, max(getattr(cfg, name), RECOMPILE_LIMIT))


def deterministic_compile(fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
    """``torch.compile(fn, **kwargs)`` with Inductor's deterministic mode for its compilations. By default Inductor
    times several block sizes of each reduction kernel (RMSNorm, softmax, logsumexp) at its first launch and keeps the
    fastest; they sum in different orders, so processes sharing a card (a comparison's children, three per card)
    picked differently and sampled different tokens from the same weights and seeds. The deterministic mode takes
    its heuristic's choice instead. It is passed as a compile option, not set globally: Dynamo resets the global
    ``torch._inductor.config.deterministic`` to ``torch.are_deterministic_algorithms_enabled()`` after every frame
    it compiles. ``TORCHINDUCTOR_DETERMINISTIC=0`` in the environment leaves the timing on."""
    import torch._inductor.config  # here, not at the top: Inductor's import costs ~1.5 s that a config check need not

    if hasattr(torch._inductor.config, "deterministic") and os.environ.get("TORCHINDUCTOR_DETERMINISTIC") != "0":
        kwargs["options"] = {**kwargs.get("options", {}), "deterministic": True}
    return torch.compile(fn, **kwargs)


def _dispatching_forward(eager: Callable[..., Any], compiled: Callable[..., Any]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        if any(kwargs.get(k) is not None for k in _CACHE_KWARGS):
            return eager(*args, **kwargs)
        return compiled(*args, **kwargs)

    forward.__gearlab_compiled__ = True  # type: ignore[attr-defined]
    return forward


def compile_decoder_layers(model: nn.Module) -> int:
    """Replace each decoder layer's ``forward`` of an HF causal LM by a compiled one for cache-free calls.

    Idempotent; returns the number of layers compiled by this call. Call it after any ``deepcopy`` of the
    model (a copy would share the original's compiled bound methods).
    """
    raise_recompile_limit()
    n = 0
    for layer in decoder_layers(model):
        if getattr(layer.forward, "__gearlab_compiled__", False):
            continue
        eager = layer.forward  # the bound method of the class
        layer.forward = _dispatching_forward(eager, deterministic_compile(eager, dynamic=None))
        n += 1
    return n


_FUNCTIONS: dict[Callable[..., Any], Callable[..., Any]] = {}


def compiled_function(fn: Callable[..., Any], enabled: bool = True) -> Callable[..., Any]:
    """``torch.compile(fn)``, made once per function and reused (``fn`` itself when not ``enabled``)."""
    if not enabled:
        return fn
    if fn not in _FUNCTIONS:
        raise_recompile_limit()
        _FUNCTIONS[fn] = deterministic_compile(fn, dynamic=None)
    return _FUNCTIONS[fn]


def is_compiled(model: nn.Module) -> bool:
    """True when ``compile_decoder_layers`` has been applied to ``model``."""
    return all(getattr(layer.forward, "__gearlab_compiled__", False) for layer in decoder_layers(model))
