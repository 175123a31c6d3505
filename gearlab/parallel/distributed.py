"""Data-parallel strategies through Lightning: DDP, FSDP2 (``ModelParallelStrategy`` + ``fully_shard``)
and FSDP1 (``FSDPStrategy``, GPU only, each model wrapped by ``wrap_fsdp1`` in ``configure_model``).

FSDP2 is the default with more than one process: it is the only sharded strategy Lightning runs on
CPU (gloo) as well as on GPUs, so the CI tests the same code path a GPU cluster runs. Sharding:
every decoder layer is its own FSDP unit, then the root (embeddings, final norm, head); the root
keeps its parameters gathered after forward, which is what lets the chunked log-prob head
(``gearlab.core.logprobs``) use the head weight right after the model's forward.
Mixed precision on GPUs: parameters computed in bf16, gradients reduced in fp32, fp32 master weights.

Launching on several nodes is Lightning's job: under ``torchrun`` or SLURM ``srun`` its cluster
environments read the rank variables; ``trainer.num_nodes`` × ``trainer.devices`` must equal the
world size they describe.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from gearlab.errors import ConfigError

if TYPE_CHECKING:  # the schema is only a type here: parallel sits below the config in the layers
    from gearlab.config import Config


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
    gpu = cfg.trainer.accelerator in ("gpu", "cuda") or (
        cfg.trainer.accelerator == "auto" and torch.cuda.is_available()
    )
    if s == "fsdp1" and not gpu:
        raise ConfigError("key 'trainer.strategy': fsdp1 needs GPUs (PyTorch's FSDP1 does not run on CPU); use fsdp2")
    if cfg.trainer.cpu_offload and s != "fsdp2":
        raise ConfigError(f"key 'trainer.cpu_offload': only with trainer.strategy=fsdp2 (got {s})")
    if cfg.trainer.compile and s == "fsdp1":
        raise ConfigError(
            "key 'trainer.compile': not with trainer.strategy=fsdp1 (its flattened parameters); use fsdp2"
        )
    if s in ("ddp", "fsdp2", "fsdp1") and cfg.rollout.prompts_per_step % world_size(cfg):
        raise ConfigError(f"key 'rollout.prompts_per_step': {cfg.rollout.prompts_per_step} is not divisible by the "
                          f"{world_size(cfg)} processes (trainer.devices × trainer.num_nodes)")


def leave_process_group(timeout_s: float = 60.0) -> None:
    """Tear down the default process group, if any, while the interpreter is still whole.

    Left to interpreter shutdown, gloo's worker threads may still own tensors whose release needs the GIL, and
    the process aborts (SIGABRT, "terminate called without an active exception"; pytorch issue 190489) after
    its work is done. Every rank first meets the others (bounded on gloo: a rank that raised never arrives), so
    none tears down under a peer still in a collective. Idempotent."""
    import datetime

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))
        else:
            dist.barrier()
    except Exception:  # noqa: BLE001 - a peer already gone: tear down anyway
        pass
    dist.destroy_process_group()


_EXIT_TEARDOWN = False


def _teardown_at_exit() -> None:
    """Run :func:`leave_process_group` from ``atexit`` (before interpreter finalisation), once per process."""
    global _EXIT_TEARDOWN
    if not _EXIT_TEARDOWN:
        import atexit

        atexit.register(leave_process_group)
        _EXIT_TEARDOWN = True


def make_strategy(cfg: Config) -> Any:
    """The Lightning strategy object (or the string "auto" for one device). A multi-process strategy also
    registers the process group's teardown at interpreter exit (:func:`leave_process_group`)."""
    s = strategy_name(cfg)
    if s == "single":
        return "auto"
    _teardown_at_exit()
    if s == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(find_unused_parameters=False)
    if s == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        # sharding itself happens in GRPOModule.configure_model → shard_fsdp2
        return ModelParallelStrategy(data_parallel_size=world_size(cfg), tensor_parallel_size=1,
                                     save_distributed_checkpoint=True)
    from lightning.pytorch.strategies import FSDPStrategy

    # no auto-wrap here: GRPOModule.configure_model wraps each model itself (wrap_fsdp1), so Lightning leaves
    # the LightningModule unwrapped and training_step — with its manual backward — runs outside any FSDP1
    # forward (wrapping the LightningModule, Lightning's default, fails: Lightning issues #19626 / #19685)
    return FSDPStrategy(sharding_strategy="FULL_SHARD", state_dict_type="sharded", limit_all_gathers=True)


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


def decoder_layer_classes(model: nn.Module) -> set[type]:
    """The decoder-layer classes of ``model`` (FSDP1's auto-wrap policy)."""
    return {type(layer) for layer in decoder_layers(model)}


def wrap_fsdp1(model: nn.Module, device: torch.device, *, bf16: bool) -> nn.Module:
    """FSDP1 (``FullyShardedDataParallel``) around one HF causal LM: a unit per decoder layer, the root holding
    embeddings, final norm and head. ``use_orig_params=False``: after the root's forward its unsharded
    parameters stay allocated (FSDP1 never frees the root after forward) and the module's weights stay
    views of them, which the chunked log-prob head reads right after the forward (``gearlab.core.logprobs``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    mp = MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16
    ) if bf16 else None
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy(decoder_layer_classes(model)),
                sharding_strategy=ShardingStrategy.FULL_SHARD,
                mixed_precision=mp, device_id=device, use_orig_params=False, limit_all_gathers=True)


def is_fsdp1(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return isinstance(model, FSDP)


def shard_fsdp2(modules: list[nn.Module], mesh: Any, *, bf16: bool, cpu_offload: bool) -> None:
    """``fully_shard`` each decoder layer, then the model root, for every model in ``modules`` (policy,
    frozen reference / teacher copies: each rank holds only its shard of each).

    ``bf16`` (``trainer.precision=bf16-mixed`` on a GPU): the sharded run computes exactly what one unsharded
    process computes under bf16 autocast, so that 1 and N GPUs give the same run. Only the decoder layers' matrix
    weights are gathered in bfloat16 (autocast would cast them to it anyway, to the same bits); the norms (one small
    unit per layer) and the root's embedding and head keep their float32 master dtype, as under autocast, where the
    residual stream and the norms stay float32. Gathering every parameter in bfloat16, FSDP2's usual setting, puts
    the embedding and norms in bfloat16 too: another computation than one GPU's, whose rounding flips sampled
    tokens from the first rollout on. Gradients are reduced in float32."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kw: dict[str, Any] = {"mesh": mesh}
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    # (cast_forward_inputs off: the float32 residual stream enters each layer as it is, as under autocast)
    matrices = {**kw, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                        cast_forward_inputs=False)}
    for m in modules:
        for layer in decoder_layers(m):
            norms = [sub for sub in _own_param_modules(layer) if not isinstance(sub, nn.Linear)] if bf16 else []
            if norms:  # RMSNorm / LayerNorm (and Qwen3's q/k norms): one float32 unit, one all-gather per layer
                fully_shard(norms, **kw)
            fully_shard(layer, **(matrices if bf16 else kw))
        fully_shard(m, **kw)


def _own_param_modules(layer: nn.Module) -> list[nn.Module]:
    """The submodules of ``layer`` (not itself) that hold parameters of their own."""
    return [sub for sub in layer.modules() if sub is not layer and any(True for _ in sub.parameters(recurse=False))]


def global_max_int(x: int, device: torch.device) -> int:
    """max of ``x`` over the ranks of the default process group (``x`` itself without one); every rank calls it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    t = torch.tensor([x], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _group() -> tuple[int, int]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(), dist.get_rank()


def gather_rows(x: torch.Tensor) -> torch.Tensor:
    """The rows of every rank, in rank order: x [n, ...] on each rank → [world · n, ...] (x itself without a process
    group). Every rank must pass the same n; a [n, T] tensor whose T differs between ranks is right-padded with 0 to
    the largest T first. Every rank calls it."""
    import torch.distributed as dist

    world, _ = _group()
    if world == 1:
        return x
    if x.dim() == 2:
        width = global_max_int(x.shape[1], x.device)
        x = torch.nn.functional.pad(x, (0, width - x.shape[1]))
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def gather_values(x: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor of any length per rank → the concatenation over ranks in rank order (x without a process group),
    e.g. for a batch statistic (a median, a sum) that must not depend on how the batch is split. Every rank calls
    it."""
    world, _ = _group()
    if world == 1:
        return x
    n = torch.tensor([x.numel()], device=x.device)
    counts = gather_rows(n).tolist()
    padded = torch.nn.functional.pad(x.reshape(-1), (0, max(counts) - x.numel()))
    rows = gather_rows(padded[None])  # [world, max]
    return torch.cat([rows[r, :c] for r, c in enumerate(counts)])


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over ranks (a new tensor; x itself without a process group). Every rank calls it."""
    import torch.distributed as dist

    if _group()[0] == 1:
        return x
    x = x.clone()
    dist.all_reduce(x)
    return x


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return is_fsdp1(model) or any(isinstance(p, DTensor) for p in model.parameters())


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model state on CPU (a collective under FSDP2: call it on every rank); the plain
    state dict for an unsharded model."""
    if not is_sharded(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    # FSDP1 and FSDP2 alike (names without FSDP1's wrapper prefixes)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@contextmanager
def _kept_gathered(model: nn.Module, *, through_backward: bool, eager: bool) -> Iterator[None]:
    """FSDP2: no unit reshards after its forward (nor after its backward with ``through_backward``) for the block;
    ``eager`` gathers every unit on entry (a collective) instead of at its first forward. Everything resharded and
    the defaults restored on exit. No-op for a model with no FSDP2 unit."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield
        return
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        if through_backward:
            m.set_reshard_after_backward(False, recurse=False)
    if eager:
        for m in units:
            m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.set_reshard_after_forward(m is not model, recurse=False)  # the root never reshards after forward
            if through_backward:
                m.set_reshard_after_backward(True, recurse=False)
            m.reshard()


@contextmanager
def gathered_for_generation(model: nn.Module) -> Iterator[None]:
    """Keep an FSDP2 model's parameters gathered for the duration of the block (autoregressive decoding
    runs hundreds of forwards: gathering every layer once beats gathering it at every token). Each rank
    then holds the full weights in their compute dtype for the block. FSDP1: only the root's own weights
    are gathered (its layer units gather at each forward). No-op for an unsharded model."""
    if is_fsdp1(model):  # the root's own weights gathered; the layer units gather per forward (as TRL does)
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model, recurse=False, writeback=False):
            yield
        return
    with _kept_gathered(model, through_backward=False, eager=False):
        yield


@contextmanager
def gathered_for_signals(model: nn.Module) -> Iterator[None]:
    """Gather an FSDP2 model's parameters once, on entry, and keep them gathered through every forward and
    input-gradient backward of the block: a model-based signal runs as many passes as it has rows to score, which
    differs between ranks (rows with nothing to score, rows left out by ``SignalContext.rows``), and passes that
    gathered layer by layer would leave ranks waiting on each other's all-gathers. Entering is the one collective:
    every rank enters. No-op for an unsharded model, and for FSDP1, whose layer units gather at every forward
    whatever is asked (training refuses FSDP1 with such signals: gearlab.trainer.preflight.preflight)."""
    if is_fsdp1(model):
        yield
        return
    with _kept_gathered(model, through_backward=True, eager=True):
        yield


@contextmanager
def unsharded(model: nn.Module) -> Iterator[None]:
    """Every parameter of an FSDP model gathered as a plain tensor for the block, for code that uses the
    modules' weights directly rather than through their forward (``gearlab.rollout.decoder``); a collective
    (every rank enters it). FSDP2: each unit unsharded, resharded on exit. FSDP1: ``summon_full_params``
    (no writeback). No-op for an unsharded model."""
    from torch.distributed.fsdp import FSDPModule

    if is_fsdp1(model):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model, recurse=True, writeback=False):
            yield
        return
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()
