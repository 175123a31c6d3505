"""A plain, unsharded copy of a sharded policy for decoding, refreshed in place after each optimizer step.

A CUDA graph records the addresses of the tensors it reads. FSDP gathers a sharded policy's weights into new
storage on every unshard, so graphs captured over the gathered weights die with the next gather. ``DecodeReplica``
keeps one set of full-size weight tensors (the dtype FSDP computes in, e.g. bf16 under bf16-mixed) at fixed
addresses and copies the current weights into them, one FSDP unit at a time, so graphs captured over the replica
stay valid from one rollout to the next. Its cost is the replica itself, resident during the update too:
2 bytes per parameter on every rank in bf16 (8 GB at Qwen3-4B, 16 GB at 8B).

``refresh`` is a collective (each unit is all-gathered): every rank calls it, the same number of times.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from gearlab.parallel.distributed import is_fsdp1

_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module.")


def _clean(name: str) -> str:
    for p in _WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name


def _gathered_units(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Yield the model's parameters and buffers as full, plain tensors, a few at a time: FSDP2 one unit at a time
    (each resharded before the next gathers), FSDP1 all at once (``summon_full_params``), else the model's own.
    Every rank iterates to the end (each step is a collective under FSDP)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    buffers = {_clean(n): b for n, b in model.named_buffers()}
    if is_fsdp1(model):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model, recurse=True, writeback=False):
            yield {**{_clean(n): p.detach() for n, p in model.named_parameters()}, **buffers}
        return
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield {**{_clean(n): p.detach() for n, p in model.named_parameters()}, **buffers}
        return
    yield buffers
    done: set[str] = set()
    for unit in reversed(units):  # children first: a unit's unshard gathers its own parameters, not its children's
        unit.unshard()
        try:
            got = {}
            for n, p in model.named_parameters():
                n = _clean(n)
                if n not in done and not isinstance(p, DTensor):
                    got[n] = p.detach()
            done.update(got)
            yield got
        finally:
            unit.reshard()


class DecodeReplica:
    """A plain module with ``model``'s architecture whose weights are refreshed in place from a (sharded) model."""

    def __init__(self) -> None:
        self.module: nn.Module | None = None
        self._slots: dict[str, torch.Tensor] = {}  # name → the replica's tensor (tied names share one)
        self.refreshes = 0

    def refresh(self, model: nn.Module) -> nn.Module:
        """Copy ``model``'s current weights into the replica (built on the first call) and return it. A collective
        under FSDP. Raises ValueError if the replica's and the model's tensor names differ."""
        first = self.module is None
        if first:
            self.module = _empty_like_architecture(model)
            self._slots = {**dict(self.module.named_parameters()), **dict(self.module.named_buffers())}
        seen: set[str] = set()
        with torch.no_grad():
            for tensors in _gathered_units(model):
                for name, src in tensors.items():
                    if name not in self._slots:
                        raise ValueError(f"the decode replica has no tensor {name!r} (model {type(model).__name__})")
                    dst = self._slots[name]
                    if first:  # materialise in the dtype and on the device FSDP computes in
                        dst = self._materialise(name, src)
                    dst.copy_(src)
                    seen.add(name)
        missing = set(self._slots) - seen  # (tied names share one slot: named_parameters lists each once)
        if missing:
            raise ValueError(f"the decode replica got no value for {sorted(missing)[:3]}")
        self.refreshes += 1
        return self.module

    def nbytes(self) -> int:
        """Bytes held by the replica's parameters (tied ones counted once)."""
        return sum(p.numel() * p.element_size() for p in self.module.parameters()) if self.module is not None else 0

    def _materialise(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """Replace the meta tensor of ``name`` (and of every name tied to it) by an empty one shaped like ``like``."""
        meta = self._slots[name]
        new = torch.empty_like(like, memory_format=torch.contiguous_format)
        if isinstance(meta, nn.Parameter):
            new = nn.Parameter(new, requires_grad=False)
        for mod_name, mod in self.module.named_modules(remove_duplicate=False):
            for table in (mod._parameters, mod._buffers):
                for attr, t in list(table.items()):
                    if t is meta:  # every slot that held it (a tied head) gets the one new tensor
                        table[attr] = new
                        key = f"{mod_name}.{attr}" if mod_name else attr
                        if key in self._slots:
                            self._slots[key] = new
        return new


def _empty_like_architecture(model: nn.Module) -> nn.Module:
    """A Hugging Face model of ``model``'s config on the meta device (no memory; tied weights kept tied), in eval
    mode, without gradients."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        rep = AutoModelForCausalLM.from_config(model.config)
    rep.eval()
    rep.requires_grad_(False)
    return rep
