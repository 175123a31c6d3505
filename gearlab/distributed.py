"""Data-parallel strategies through Lightning: DDP, FSDP2 (``ModelParallelStrategy`` + ``fully_shard``)
and FSDP1 (``FSDPStrategy``, GPU only; refused for now — see ``check``).

FSDP2 is the default with more than one process: it is the only sharded strategy Lightning runs on
CPU (gloo) as well as on GPUs, so the CI tests the same code path a GPU cluster runs. Sharding:
every decoder layer is its own FSDP unit, then the root (embeddings, final norm, head); the root
keeps its parameters gathered after forward, which is what lets the chunked log-prob head
(``gearlab.logprobs``) use the head weight right after the model's forward.
Mixed precision on GPUs: parameters computed in bf16, gradients reduced in fp32, fp32 master weights.

Launching on several nodes is Lightning's job: under ``torchrun`` or SLURM ``srun`` its cluster
environments read the rank variables; ``trainer.num_nodes`` × ``trainer.devices`` must equal the
world size they describe.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from gearlab.config import Config, ConfigError


def world_size(cfg: Config) -> int:
    return cfg.trainer.devices * cfg.trainer.num_nodes


def strategy_name(cfg: Config) -> str:
    """The strategy actually used: ``auto`` resolves to fsdp2 for more than one process, else single."""
    s = cfg.trainer.strategy
    if s == "auto":
        return "fsdp2" if world_size(cfg) > 1 else "single"
    return s


def check(cfg: Config) -> None:
    """Combinations that cannot work, as one-line ConfigErrors before any work."""
    s = strategy_name(cfg)
    gpu = cfg.trainer.accelerator in ("gpu", "cuda") or (cfg.trainer.accelerator == "auto" and torch.cuda.is_available())
    if s == "fsdp1":
        # Seen on 2×H200 (tests/distributed/parity_script.py … fsdp1 gpu): Lightning's FSDPStrategy wraps the
        # LightningModule in the FSDP1 root and runs training_step inside the root's forward; gearlab's manual
        # optimization calls backward there, and FSDP1's post-backward hook asserts ("Expects BACKWARD_PRE or
        # BACKWARD_POST state but got FORWARD") — the open Lightning issues #19626 / #19685. Also, FSDP1 keeps
        # the root's parameters as sharded views after forward, which the chunked log-prob head cannot use.
        raise ConfigError("key 'trainer.strategy': fsdp1 is not supported (Lightning's FSDPStrategy runs training_step "
                          "inside the FSDP1 root's forward, where manual-optimization backward fails); use fsdp2"
                          + ("" if gpu else " — fsdp1 also needs GPUs"))
    if cfg.trainer.cpu_offload and s != "fsdp2":
        raise ConfigError(f"key 'trainer.cpu_offload': only with trainer.strategy=fsdp2 (got {s})")
    if s in ("ddp", "fsdp2", "fsdp1") and cfg.rollout.prompts_per_step % world_size(cfg):
        raise ConfigError(f"key 'rollout.prompts_per_step': {cfg.rollout.prompts_per_step} is not divisible by the "
                          f"{world_size(cfg)} processes (trainer.devices × trainer.num_nodes)")


def make_strategy(cfg: Config) -> Any:
    """The Lightning strategy object (or the string "auto" for one device)."""
    s = strategy_name(cfg)
    if s == "single":
        return "auto"
    if s == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(find_unused_parameters=False)
    if s == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        # sharding itself happens in GRPOModule.configure_model → shard_fsdp2
        return ModelParallelStrategy(data_parallel_size=world_size(cfg), tensor_parallel_size=1,
                                     save_distributed_checkpoint=True)
    from lightning.pytorch.strategies import FSDPStrategy

    return FSDPStrategy(auto_wrap_policy=decoder_layer_classes(None), sharding_strategy="FULL_SHARD",
                        state_dict_type="sharded", limit_all_gathers=True, cpu_offload=False)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of an HF causal LM (``model.model.layers`` and alike)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    for name in ("layers", "h", "blocks", "decoder.layers"):
        obj: Any = base
        for part in name.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, nn.ModuleList) and len(obj):
            return list(obj)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")


def decoder_layer_classes(model: nn.Module | None) -> set[type] | None:
    """Layer classes for FSDP1's auto-wrap policy (None → Lightning resolves at setup for Qwen3/Llama)."""
    if model is None:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

        return {Qwen3DecoderLayer, LlamaDecoderLayer}
    return {type(layer) for layer in decoder_layers(model)}


def shard_fsdp2(modules: list[nn.Module], mesh: Any, *, bf16: bool, cpu_offload: bool) -> None:
    """``fully_shard`` each decoder layer, then the model root, for every model in ``modules`` (policy,
    frozen reference / teacher copies: each rank holds only its shard of each)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kw: dict[str, Any] = {"mesh": mesh}
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    for m in modules:
        for layer in decoder_layers(m):
            fully_shard(layer, **kw)
        fully_shard(m, **kw)


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model state on CPU (a collective under FSDP2: call it on every rank); the plain
    state dict for an unsharded model."""
    if not is_sharded(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@contextmanager
def gathered_for_generation(model: nn.Module) -> Iterator[None]:
    """Keep an FSDP2 model's parameters gathered for the duration of the block (autoregressive decoding
    runs hundreds of forwards: gathering every layer once beats gathering it at every token). Each rank
    then holds the full weights in their compute dtype for the block. No-op for an unsharded model."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield
        return
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in units:
            m.set_reshard_after_forward(m is not model, recurse=False)  # the root never reshards after forward
            m.reshard()
