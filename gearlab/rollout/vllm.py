"""A colocated vLLM engine as gearlab's token generator (``rollout.engine=vllm``).

Each training process owns one in-process vLLM ``LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: deterministic
scheduling and no second process holding the weights). The single- and multi-turn rollout engines call
``sample`` exactly as they call HF ``generate``: prompt ids in, sampled ids out (``TokensPrompt``, no
decode / re-encode), plus vLLM's log-prob of every sampled token, which the trainer compares with its own
(``grpo.engine_mismatch``) and can correct for (``algorithm.tis_cap``).

Weights. After each optimizer step the module calls ``mark_stale``; the next ``sample`` first brings the
engine up to date:
- ``inplace``: the policy's state dict is streamed into vLLM's ``reload_weights`` (its layerwise in-place
  reload, which re-runs each layer's kernel preparation — the CPU backend's prepacked GEMM weights
  included). Parameters are gathered from FSDP2 shards a bucket (``bucket_mb``) at a time, so at most one
  bucket of full tensors exists beyond the engine's own copy.
- ``reload``: the fallback — the consolidated weights are saved as an HF folder and the engine is rebuilt
  from it.
``auto`` takes ``inplace``, then checks it once: the engine's log-probs of a short probe must match the
trainer's; if they do not, it logs the failure and falls back to ``reload`` for the rest of the run.
Which path ran is logged (``vllm/weight_sync_inplace``) and said once at INFO.

GPU-only parts: ``sleep`` (``LLM.sleep`` after the rollout frees its memory for the update,
``wake_up(["weights"])`` before the sync, ``wake_up(["kv_cache"])`` before generating) ran with vLLM 0.25.0 on one
H200 and, FSDP2 with one engine per rank, on 2× H200 (experiments/bench/results/engines_h200x2.md). Tensor
parallelism (``tensor_parallel_size`` > 1 with vLLM's ``external_launcher`` backend: the ranks of one TP group pool
their prompts, generate together, and each keeps its own rows) is written against vLLM's documented API and has
not run on GPUs.

Seeds: request ``i`` of a call gets seed ``seed + i`` (vLLM's per-request generator; or the per-row seeds given,
``gearlab.rollout.base.row_seeds``), so a row's sample depends only on (run seed, step, global row) and the
weights — paired runs stay paired, and the number of ranks changes no seed.
"""
from __future__ import annotations

import gc
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

from gearlab.rollout.base import SamplingParams, row_seeds, stop_token_ids

log = logging.getLogger("gearlab")

PROBE_TOL = 0.05  # mean |Δ log-prob| (nats) above which an in-place sync is judged wrong


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


def compute_dtype(model: nn.Module) -> str:
    """The dtype ``model`` computes in, as vLLM names it: autocast's when autocast is on for its device (Lightning's
    bf16-mixed over fp32 master weights → ``bfloat16``), else its parameters' dtype. The fast decoder decodes under
    the same autocast, so both engines sample from the policy the trainer scores."""
    p = next(model.parameters())
    dev = p.device.type
    if torch.is_autocast_enabled(dev):
        return str(torch.get_autocast_dtype(dev)).removeprefix("torch.")
    return str(p.dtype).removeprefix("torch.")


class VLLMGenerator:
    """vLLM behind gearlab's ``TokenGenerator`` protocol (see the module docstring)."""

    def __init__(self, tokenizer: Any, *, model_dir: str | None = None, weight_sync: str = "auto", bucket_mb: int = 512,
                 sleep: str = "auto", sleep_level: int = 0, gpu_memory_utilization: float = 0.3,
                 tensor_parallel_size: int = 1, max_model_len: int = 1024, enforce_eager: bool = True,
                 dtype: str = "auto", cpu_kv_cache_gb: int = 1, workdir: str | None = None,
                 llm_factory: Callable[..., Any] | None = None) -> None:
        self.tok = tokenizer
        self.stop_ids = stop_token_ids(tokenizer)  # the HF engine's stop tokens
        self.model_dir = model_dir  # an HF folder with the policy's architecture (and tokenizer), to start from
        self.weight_sync = weight_sync
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.sleep_mode = sleep
        self.sleep_level = sleep_level
        self.gpu_memory_utilization = gpu_memory_utilization
        self.tp = tensor_parallel_size
        self.max_model_len = max_model_len
        self.enforce_eager = enforce_eager
        self.dtype = dtype
        self.cpu_kv_cache_gb = cpu_kv_cache_gb
        self._workdir = workdir
        self._factory = llm_factory  # tests inject a fake engine here; default: vllm.LLM
        self.llm: Any = None
        self.stale = True
        self.asleep = False
        self.path: str | None = None  # the sync path in use: inplace | reload
        self._stats: dict[str, float] = {}
        self._saves = 0

    @classmethod
    def from_config(cls, tokenizer: Any, cfg: Any) -> "VLLMGenerator":
        v, r = cfg.rollout.vllm, cfg.rollout
        max_len = v.max_model_len or _round_up(
            2048 + r.max_new_tokens * max(1, r.max_turns or 1) + (r.max_total_tokens or 0), 256
        )
        src = cfg.model.name_or_path
        return cls(tokenizer, model_dir=src if Path(str(src)).is_dir() else None, weight_sync=v.weight_sync,
                   bucket_mb=v.bucket_mb, sleep=v.sleep, sleep_level=v.sleep_level,
                   gpu_memory_utilization=v.gpu_memory_utilization, tensor_parallel_size=v.tensor_parallel_size,
                   max_model_len=max_len, enforce_eager=v.enforce_eager, dtype=v.dtype,
                   cpu_kv_cache_gb=v.cpu_kv_cache_gb)

    # -- the TokenGenerator protocol ------------------------------------------------------------
    def sample(self, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, sampling: SamplingParams,
               seed: int, step_offset: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Left-padded prompts [N, P] → (response ids [N, T] right-padded with pad, mask [N, T] bool, vLLM's
        log-probs of the sampled tokens [N, T] float32, 0 on padding). A response ends at and includes its
        first stop token, as with HF ``generate``. ``step_offset`` is accepted and has no effect: vLLM's own
        per-request generator cannot start mid-stream, so a continuation is a fresh sample from the prefix."""
        self._ready(model)
        rows = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids, prompt_mask)]
        rows, keep, seeds = self._tp_pool(rows, row_seeds(seed, len(rows)).tolist())
        if not rows:  # (a rank with nothing to generate this turn)
            return torch.zeros((0, 1), dtype=torch.long), torch.zeros((0, 1), dtype=torch.bool), torch.zeros((0, 1))
        params = [self._params(sampling, s) for s in seeds]
        from vllm.inputs import TokensPrompt

        outs = self.llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], params, use_tqdm=False)
        outs = [outs[i] for i in keep]
        seqs = [list(o.outputs[0].token_ids) for o in outs]
        lps = [_sampled_logprobs(o.outputs[0]) for o in outs]
        T = max(1, max((len(s) for s in seqs), default=0))
        pad = self.tok.pad_token_id
        resp = torch.full((len(seqs), T), pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), T), dtype=torch.bool)
        lp = torch.zeros((len(seqs), T), dtype=torch.float32)
        for i, (s, row_lp) in enumerate(zip(seqs, lps)):
            resp[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = True
            lp[i, : len(row_lp)] = torch.tensor(row_lp, dtype=torch.float32)
        return resp, mask, lp

    # -- module hooks -----------------------------------------------------------------------------
    def mark_stale(self) -> None:
        """The policy's weights changed (an optimizer step): sync before the next rollout."""
        self.stale = True

    def release(self) -> None:
        """Rollout done: on GPUs with sleep on, free the engine's memory for the update."""
        if self.llm is not None and self._sleep_on() and not self.asleep:
            t = time.perf_counter()
            # auto: 1 while weights sync in place (level 2 would also drop buffers no checkpoint holds, such as the
            # rotary cos/sin cache, which an in-place reload does not restore); 2 with reload (the engine is rebuilt)
            level = self.sleep_level or (1 if self.path == "inplace" else 2)
            self.llm.sleep(level=level)
            self.asleep = True
            if level == 2:  # the weights are gone: the next call must sync, optimizer step or not
                self.stale = True
            self._stats["vllm/sleep_s"] = time.perf_counter() - t

    def stats(self) -> dict[str, float]:
        """Metrics of the last sync / sleep (MLflow keys), then cleared."""
        out, self._stats = dict(self._stats), {}
        return out

    # -- weights -------------------------------------------------------------------------------------
    def _ready(self, model: nn.Module) -> None:
        if self.llm is None:
            self.path = "reload" if self.weight_sync == "reload" else "inplace"
            t = time.perf_counter()
            if self.dtype == "auto":
                self.dtype = compute_dtype(model)
            self.max_model_len = min(
                self.max_model_len, getattr(model.config, "max_position_embeddings", self.max_model_len)
            )
            origin = self.model_dir or getattr(model, "name_or_path", None)
            if self.path == "inplace":
                # start from the folder the policy came from, or with placeholder weights from its config alone
                # (every rank writes its own, so no rank waits for another's file, on any node): the in-place sync
                # right after replaces them
                has_origin = bool(origin) and Path(str(origin), "config.json").is_file()
                self.llm = self._build(str(origin) if has_origin else self._save_config(model),
                                       dummy=not has_origin)
                self.stale = True
            else:  # reload: from the current weights (a freshly saved folder holds them already)
                self.llm = self._build(self._save(model))
                self.stale = False
            self._stats["vllm/build_s"] = time.perf_counter() - t
            log.info("vLLM engine built in %.1f s (weight sync: %s)", time.perf_counter() - t, self.path)
        if self.asleep and self.stale and self.path == "reload":  # rebuilt from a new folder: no wake-up
            self.asleep = False
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        if self.stale:
            self._sync(model)
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False

    def _sync(self, model: nn.Module) -> None:
        t = time.perf_counter()
        if self.path == "inplace":
            n_bytes, n_buckets = self._sync_inplace(model)
            self._stats.update({"vllm/weight_sync_mb": n_bytes / 2**20, "vllm/weight_sync_buckets": float(n_buckets)})
            if self.weight_sync == "auto" and not getattr(self, "_probed", False):
                self._probed = True
                err = self._probe(model)
                self._stats["vllm/probe_lp_diff"] = err
                if err > PROBE_TOL:
                    log.warning("vLLM in-place weight sync gives log-probs %.3g nats from the trainer's on a probe: "
                                "falling back to rebuilding the engine from a saved checkpoint (weight_sync=reload)",
                                err)
                    self.path = "reload"
                    self._rebuild(model)
                else:
                    log.info("vLLM in-place weight sync checked on a probe (mean |Δ log-prob| %.2g)", err)
        else:
            self._rebuild(model)
        self.stale = False
        self._stats["vllm/weight_sync_s"] = time.perf_counter() - t
        self._stats["vllm/weight_sync_inplace"] = float(self.path == "inplace")

    def _sync_inplace(self, model: nn.Module) -> tuple[int, int]:
        counted = {"bytes": 0, "buckets": 0}
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": self._bucketed(model, counted),
                                                          "is_checkpoint_format": True})
        return counted["bytes"], counted["buckets"]

    def _bucketed(self, model: nn.Module, counted: dict[str, int]) -> Iterator[tuple[str, Tensor]]:
        """(name, full tensor) in state-dict order, gathered a bucket at a time (FSDP2 DTensors: one
        ``full_tensor`` collective per parameter, every rank in the same order)."""
        from torch.distributed.tensor import DTensor

        dtype = self._engine_dtype(model)
        bucket: list[tuple[str, Tensor]] = []
        size = 0
        for name, t in model.state_dict().items():
            if isinstance(t, DTensor):
                t = t.full_tensor()
            t = t.detach().to(dtype)
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size >= self.bucket_bytes:
                counted["bytes"] += size
                counted["buckets"] += 1
                yield from bucket
                bucket, size = [], 0
        if bucket:
            counted["bytes"] += size
            counted["buckets"] += 1
            yield from bucket

    def _rebuild(self, model: nn.Module) -> None:
        src = self._save(model)
        self._shutdown()
        self.llm = self._build(src)

    def _save(self, model: nn.Module) -> str:
        """The policy's current weights as an HF folder (a collective under FSDP2: every rank calls it). Several
        processes: the full state exists on rank 0 only, which writes the folder into its ``workdir`` and sends
        every rank its path (the broadcast follows the write) — ranks on other nodes need ``workdir`` on a file
        system they share."""
        import torch.distributed as dist

        from gearlab.parallel.distributed import full_state_dict

        state = full_state_dict(model)
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        self._saves += 1
        multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        out = Path(self.workdir) / f"weights-{self._saves % 2}"  # two slots: never overwrite the folder in use
        if not multi or dist.get_rank() == 0:
            if out.exists():
                shutil.rmtree(out)
            model.save_pretrained(out, state_dict=state)
            self.tok.save_pretrained(out)
        if multi:
            box = [str(out)]
            dist.broadcast_object_list(box, src=0)
            out = Path(box[0])
        return str(out)

    def _save_config(self, model: nn.Module) -> str:
        """This rank's folder with the policy's config and tokenizer but no weights (an engine with placeholder
        weights is built from it)."""
        import copy

        out = Path(self.workdir) / "config-only"
        out.mkdir(parents=True, exist_ok=True)
        config = copy.deepcopy(model.config)
        # a model built in code has no `architectures` (save_pretrained adds it): vLLM picks its runner by it.
        # FSDP2 swaps the class for a generated FSDP<name> subclass: the model's own class is the next one
        config.architectures = [next(c.__name__ for c in type(model).__mro__ if not c.__name__.startswith("FSDP"))]
        config.save_pretrained(out)
        self.tok.save_pretrained(out)
        return str(out)

    def _probe(self, model: nn.Module) -> float:
        """Mean |log π_vLLM − log π_trainer| over a short sampled continuation of a fixed prompt."""
        from gearlab.core.logprobs import response_hidden, token_logprobs

        ids = [int(i) for i in self.tok("probe: 1 2 3", add_special_tokens=False)["input_ids"]] or [1]
        from vllm.inputs import TokensPrompt

        o = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], self._params(SamplingParams(max_new_tokens=8), 0),
                              use_tqdm=False)[0].outputs[0]
        toks, lp = list(o.token_ids), _sampled_logprobs(o)
        if not toks:
            return 0.0
        dev = next(model.parameters()).device
        x = torch.tensor([ids + toks], device=dev)
        with torch.no_grad():
            h = response_hidden(model, x, torch.ones_like(x), len(ids), len(toks))
            ref, _ = token_logprobs(h, model.get_output_embeddings(), x[:, len(ids):])
        return float((ref[0].float().cpu() - torch.tensor(lp)).abs().mean())

    # -- engine ----------------------------------------------------------------------------------------
    @property
    def workdir(self) -> str:
        if self._workdir is None:
            self._workdir = tempfile.mkdtemp(prefix="gearlab-vllm-")
        return self._workdir

    def _sleep_on(self) -> bool:
        return self.sleep_mode == "on" or (self.sleep_mode == "auto" and torch.cuda.is_available())

    def _engine_dtype(self, model: nn.Module) -> torch.dtype:
        return getattr(torch, self.dtype if self.dtype != "auto" else compute_dtype(model))

    def _build(self, src: str, dummy: bool = False) -> Any:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.cpu_kv_cache_gb))
        kw: dict[str, Any] = {"model": src, "tokenizer": src, "max_model_len": self.max_model_len,
                              "enforce_eager": self.enforce_eager, "seed": 0, "logprobs_mode": "processed_logprobs",
                              "dtype": self.dtype}
        if dummy:  # placeholder weights, replaced by the in-place sync before the first sample
            kw["load_format"] = "dummy"
        if torch.cuda.is_available():
            kw["gpu_memory_utilization"] = self.gpu_memory_utilization
            kw["enable_sleep_mode"] = self._sleep_on()
        import torch.distributed as dist

        multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if self.tp > 1 or multi:
            # inside a multi-process training run vLLM must reuse the launcher's process group (TRL's colocate
            # mode does the same): each TP group of tp ranks holds one engine
            kw["tensor_parallel_size"] = self.tp
            kw["distributed_executor_backend"] = "external_launcher"
        if multi:  # it reads the torchrun variables; Lightning's own launcher does not set all of them
            os.environ.setdefault("RANK", str(dist.get_rank()))
            os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
            os.environ.setdefault(
                "LOCAL_RANK", str(dist.get_rank() % max(1, torch.cuda.device_count() or dist.get_world_size()))
            )
        if self._factory is not None:
            return self._factory(**kw)
        from vllm import LLM

        return LLM(**kw)

    def _shutdown(self) -> None:
        if self.llm is not None:
            self.llm = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _params(self, sampling: SamplingParams, seed: int) -> Any:
        from vllm import SamplingParams as VSP

        greedy = sampling.greedy
        # processed log-probs = log softmax(logits / T) when top-p / top-k are off: the trainer's convention
        return VSP(n=1, temperature=0.0 if greedy else sampling.temperature, top_p=1.0 if greedy else sampling.top_p,
                   top_k=0 if greedy else sampling.top_k, max_tokens=sampling.max_new_tokens,
                   stop_token_ids=self.stop_ids,
                   logprobs=0, seed=seed, detokenize=False)

    def _tp_pool(self, rows: list[list[int]], seeds: list[int]) -> tuple[list[list[int]], list[int], list[int]]:
        """Tensor parallelism: the ranks of one TP group must submit the SAME requests, so their prompts are
        pooled (group order) with their own per-row seeds; each keeps its own rows. Returns (requests, indices of
        this rank's rows among them, the requests' seeds). Without TP: the rows themselves."""
        if self.tp <= 1:
            return rows, list(range(len(rows))), seeds
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        if world % self.tp:
            raise ValueError(f"rollout.vllm.tensor_parallel_size={self.tp} does not divide the {world} processes")
        if not hasattr(self, "_tp_group"):  # every rank creates every group (a collective), keeps its own
            for start in range(0, world, self.tp):
                g = dist.new_group(list(range(start, start + self.tp)))
                if start <= rank < start + self.tp:
                    self._tp_group = g
        gathered: list[Any] = [None] * self.tp
        dist.all_gather_object(gathered, (rows, seeds), group=self._tp_group)
        pooled = [r for part, _ in gathered for r in part]
        offset = sum(len(part) for part, _ in gathered[: rank % self.tp])
        return pooled, list(range(offset, offset + len(rows))), [s for _, part in gathered for s in part]


def _sampled_logprobs(out: Any) -> list[float]:
    """vLLM's log-prob of each sampled token (``logprobs=0`` returns exactly that one per position)."""
    if out.logprobs is None:
        return [0.0] * len(out.token_ids)
    return [float(step[t].logprob) for step, t in zip(out.logprobs, out.token_ids)]


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m
