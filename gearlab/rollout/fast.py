"""The fast decode path for Hugging Face models (``rollout.engine=fast``): prefill once, then decode steps over a
static KV cache, each step captured whole as a CUDA graph on GPUs.

Per call, prompts are decoded ``rollout.batch_size`` rows at a time. A step feeds every row's last token through
``gearlab.rollout.decoder`` (attention over the first L cache positions: with CUDA graphs, L is the step's bucket —
the filled length rounded up to ``bucket`` tokens — and prompts are left-padded to a multiple of 64 positions,
masked, so that few shapes recur; uncaptured, on the CPU, L is the filled length itself), samples the next token
with per-row seeds (``gearlab.rollout.sampler``: row i of a call uses ``seed + i``, as the vLLM engine) and
records it with its log-prob. Rows that emitted a stop token keep running but write padding; the loop ends when
every row is done (checked every ``check_every`` steps, the only host synchronisation) or after
``max_new_tokens``. ``compile`` (``rollout.fast.compile``; default: on with CUDA) compiles each layer's pieces
around attention (``Decoder``): two graphs for every layer and cache length (two more, batch-size dynamic, once a
second batch size comes), fusing the elementwise kernels a small model's step is mostly made of. A decode step's
attention (``rollout.fast.attention``): ``auto``, the default, is gearlab's split-K Triton kernel on CUDA with Triton
and SDPA elsewhere (``resolve_attention``).

On CUDA, one graph per (batch, prompt length, bucket, sampling settings) is captured on first use and replayed
after; graphs keep pointers to the weights, which optimizer steps update in place, so they stay valid across
iterations. A sharded (FSDP) policy is decoded in one of two ways (``rollout.fast.sharded_weights``):
``gather`` gathers it once per call into FSDP's own buffers, which are new each time, so its graphs are captured
again each call, and ``release`` frees the caches and graphs before the update (``fast/graphs_captured`` counts
captures, ``fast/capture_s`` times them); ``replica`` decodes a persistent unsharded copy
(``gearlab.parallel.replica``) refreshed in place at the first call after each optimizer step, so graphs and
caches survive, at the cost of the copy and the caches staying resident during the update.

Returns what the other engines return: response ids [N, T] right-padded (T = the longest response), the mask of
generated tokens (a response ends at and includes its first stop token) and the engine's log-probs of the
sampled tokens under log_softmax(logits / T) (compared with the trainer's: ``grpo.engine_mismatch``).

Simplifications: every row of a batch runs every step until all are done (no compaction of finished rows);
autocast, if on, runs with its weight cache off (a captured graph must not replay a stale cast), so fp32 master
weights are cast at every step — keep the policy in bf16 for speed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from gearlab.parallel.distributed import is_sharded, unsharded
from gearlab.parallel.replica import DecodeReplica
from gearlab.rollout.base import STATIC_PAD, SamplingParams, pad_left_to, row_seeds, stop_token_ids, trim_left
from gearlab.rollout.decoder import Decoder, KVCache
from gearlab.rollout.fused_sample import SAMPLERS, fused_draw
from gearlab.rollout.kernels import kernel_available
from gearlab.rollout.sampler import row_uniforms, sample_rows


def decodes_on_cuda(cfg: Any) -> bool:
    """The policy decodes on CUDA: ``trainer.accelerator`` is gpu / cuda, or auto with a GPU here."""
    acc = cfg.trainer.accelerator
    return acc in ("gpu", "cuda") or (acc == "auto" and torch.cuda.is_available())


def resolve_attention(cfg: Any) -> str:
    """``rollout.fast.attention`` made concrete. ``auto`` is ``split`` when the policy decodes on CUDA and
    gearlab's Triton kernel runs there (``kernels.kernel_available``), otherwise ``sdpa``. The other values are
    returned as they are."""
    attention = cfg.rollout.fast.attention
    if attention != "auto":
        return attention
    return "split" if decodes_on_cuda(cfg) and kernel_available(torch.device("cuda")) else "sdpa"


@dataclass
class _Run:
    """The fixed-shape buffers of one (batch, prompt length, new tokens) shape; captured graphs point into them."""
    P: int
    T: int
    cache: KVCache
    tok: Tensor  # [B] the token fed to the next step
    step: Tensor  # 0-dim: index of the token the next step samples
    n_prompt: Tensor  # [B] real prompt tokens = rotary position of the first generated token
    key_ok: Tensor  # [B, P+T] prompt mask, then True
    seeds: Tensor  # [B]
    offsets: Tensor  # [B] each row's first draw number (a continued response: its prefix length)
    out_tok: Tensor  # [B, T]
    out_lp: Tensor  # [B, T]
    done: Tensor  # [B]
    stops: Tensor  # [S] the stop token ids (on the device: a captured graph cannot copy from the host)
    graphs: dict[tuple, Any] = field(default_factory=dict)
    weights: tuple = ()


class FastDecoder:
    """gearlab's ``TokenGenerator`` on the policy's own weights (see the module docstring)."""

    def __init__(self, tokenizer: Any, *, batch_size: int = 64, cuda_graphs: str = "auto", bucket: int = 64,
                 check_every: int = 8, compile: bool | None = None, sharded_weights: str = "gather",
                 fused: bool = False, attention: str = "sdpa", sampler: str = "torch") -> None:
        self.tok = tokenizer
        self.pad_id = tokenizer.pad_token_id
        self.stop_ids = stop_token_ids(tokenizer)
        self.batch_size = batch_size
        self.cuda_graphs = cuda_graphs  # auto (on with CUDA) | on | off
        self.bucket = bucket
        self.check_every = check_every
        self.compile = compile  # None: on with CUDA (resolved per policy, in _decoder_for)
        self.fused = fused  # q/k/v and gate/up as one GEMM each over copies refreshed at every call (Decoder)
        self.attention = attention  # a decode step's attention (Decoder, gearlab.rollout.attention / split_decode)
        if sampler not in SAMPLERS:
            raise ValueError(f"rollout.fast.sampler: {sampler!r} is not one of {', '.join(SAMPLERS)}")
        self.sampler = sampler  # torch | fused: plain sampling's draw (gearlab.rollout.fused_sample)
        self._runs: dict[tuple, _Run] = {}
        self._decoder: Decoder | None = None
        self._pool = None
        self._prefill_rows = [0, 0]  # rows, distinct rows prefilled (last sample call)
        self._stats: dict[str, float] = {}
        self._captured = 0
        self._capture_s = 0.0
        self.sharded_weights = sharded_weights  # gather | replica: how a sharded policy is decoded (module docstring)
        self._replica: DecodeReplica | None = None
        self._stale = True  # the replica must be refreshed before the next call
        self._refresh_s = 0.0
        self._gathered = False  # the last call decoded FSDP's gathered buffers: its graphs cannot be replayed

    @classmethod
    def from_config(cls, tokenizer: Any, cfg: Any, *, training: bool = False) -> "FastDecoder":
        """From ``rollout.fast``, ``attention=auto`` resolved (``resolve_attention``); ``sharded_weights=replica``
        only for a training run's engine (evaluation and the commands gather: a second resident copy would only cost
        memory)."""
        f = cfg.rollout.fast
        return cls(tokenizer, batch_size=cfg.rollout.batch_size, cuda_graphs=f.cuda_graphs, bucket=f.bucket,
                   check_every=f.check_every, compile=f.compile, fused=f.fused_projections,
                   attention=resolve_attention(cfg), sampler=f.sampler,
                   sharded_weights=f.sharded_weights if training else "gather")

    # -- the TokenGenerator protocol ------------------------------------------------------------
    @torch.no_grad()
    def sample(self, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, sampling: SamplingParams,
               seed: int | Tensor, step_offset: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Left-padded prompts [N, P] → (response ids [N, T] right-padded, mask [N, T] bool, the engine's log-probs
        of the sampled tokens [N, T] float32, 0 on padding)."""
        was_training = model.training
        model.eval()
        t0 = time.perf_counter()
        steps = 0
        captured, capture_s = self._captured, self._capture_s
        self._prefill_rows = [0, 0]  # rows, distinct rows prefilled
        outs: list[tuple[Tensor, Tensor]] = []
        sharded = is_sharded(model)
        target = self._refreshed(model) if sharded and self.sharded_weights == "replica" else model
        self._gathered = sharded and target is model
        try:
            with unsharded(target):
                dec = self._decoder_for(target)
                dec.refresh_fused()  # (in place: graphs captured over the copies stay valid)
                dev = dec.head.weight.device
                all_seeds = row_seeds(seed, prompt_ids.shape[0])
                all_offsets = step_offset if step_offset is not None else torch.zeros_like(all_seeds)
                for s in range(0, prompt_ids.shape[0], self.batch_size):
                    rows = slice(s, s + self.batch_size)
                    seeds = all_seeds[s : s + self.batch_size]
                    ids, mask = trim_left(prompt_ids[rows], prompt_mask[rows])
                    if self._fixed_shapes(model):  # a few prompt widths recur: captured graphs are reused
                        ids, mask = pad_left_to(ids, mask, STATIC_PAD, self.pad_id)
                    offsets = all_offsets[s : s + self.batch_size].to(dev)
                    tok, lp, n = self._decode(dec, ids.to(dev), mask.to(dev), seeds.to(dev), sampling, offsets)
                    outs.append((tok.cpu(), lp.cpu()))
                    steps += n
        finally:
            model.train(was_training)
            if not self._graphs_on(model):
                self.free()
        elapsed = time.perf_counter() - t0
        self._stats = {"fast/decode_s": elapsed, "fast/steps": float(steps),
                       "fast/ms_per_step": 1000 * elapsed / max(1, steps),
                       "fast/graphs_captured": float(self._captured - captured),
                       "fast/capture_s": self._capture_s - capture_s,
                       "fast/prefill_rows": float(self._prefill_rows[0]),
                       "fast/prefill_distinct": float(self._prefill_rows[1])}
        if self._decoder is not None and self._decoder.fw is not None:
            self._stats["fast/fused_gib"] = self._decoder.fw.nbytes() / 2**30
        if self._replica is not None:
            self._stats.update({"fast/replica_refresh_s": self._refresh_s,
                                "fast/replica_gib": self._replica.nbytes() / 2**30})
        if not outs:
            return torch.zeros((0, 1), dtype=torch.long), torch.zeros((0, 1), dtype=torch.bool), torch.zeros((0, 1))
        resp, lps = torch.cat([t for t, _ in outs]), torch.cat([lp for _, lp in outs])  # [N, max_new_tokens] each
        lengths = self._lengths(resp)
        T = max(1, int(lengths.max()))  # as wide as the longest response, as HF's output
        rmask = torch.arange(T)[None] < lengths[:, None]
        return resp[:, :T].masked_fill(~rmask, self.pad_id), rmask, lps[:, :T].masked_fill(~rmask, 0.0)

    def release(self) -> None:
        """After the rollout: free the caches and graphs if they were built over a gathered sharded policy (the
        next call captures anew anyway; the update gets the memory). Otherwise keep them for the next rollout."""
        if self._gathered:
            self.free()

    def mark_stale(self) -> None:
        """The policy's weights changed. An unsharded policy is read in place (nothing to do); a replica is
        refreshed at the next call."""
        self._stale = True

    def _refreshed(self, model: nn.Module) -> nn.Module:
        """The replica of a sharded ``model``, refreshed if an optimizer step came since (a collective)."""
        if self._replica is None:
            self._replica = DecodeReplica()
        if self._stale or self._replica.module is None:
            t0 = time.perf_counter()
            self._replica.refresh(model)
            self._refresh_s = time.perf_counter() - t0
            self._stale = False
        return self._replica.module

    def stats(self) -> dict[str, float]:
        return dict(self._stats)

    def free(self) -> None:
        """Drop every cache and captured graph (their GPU memory returns to PyTorch's allocator). The graphs' pool
        goes too: once its graphs are freed it cannot take new captures (the CUDA caching allocator asserts)."""
        self._runs.clear()
        self._pool = None

    # -- decoding -------------------------------------------------------------------------------
    def _lengths(self, tok: Tensor) -> Tensor:
        """[B, T] sampled ids (padding after a stop) → response length per row, the stop token included."""
        is_stop = torch.isin(tok, torch.tensor(self.stop_ids))
        T = tok.shape[1]
        first = torch.where(is_stop.any(1), is_stop.float().argmax(1) + 1, torch.full((tok.shape[0],), T))
        return first

    def _graphs_on(self, model: nn.Module) -> bool:
        dev = next(model.parameters()).device
        return dev.type == "cuda" and self.cuda_graphs != "off"

    def _fixed_shapes(self, model: nn.Module) -> bool:
        """Graphs want few distinct shapes (padded prompts, bucketed attention lengths); an uncaptured step is
        cheapest on exact ones (the CPU; the compiled pieces do not depend on the cache length).
        ``cuda_graphs="on"`` without CUDA keeps the graphs' shapes, eagerly: the graph path's padding and buckets,
        testable on the CPU."""
        return self._graphs_on(model) or self.cuda_graphs == "on"

    def _decoder_for(self, model: nn.Module) -> Decoder:
        compile = self.compile if self.compile is not None else next(model.parameters()).is_cuda
        d = self._decoder
        if (d is None or d.model is not model or d.compiled != compile or d.fused != self.fused
                or d.attention != self.attention):
            if compile:  # (the limit compiled layers use; the decoder's pieces need at most 2 graphs each)
                from gearlab.parallel.compiling import raise_recompile_limit

                raise_recompile_limit()
            # compiled: each layer's pieces around attention (Decoder), not the whole step — a whole 28-layer step
            # compiled once per bucket length took minutes, and Inductor's scan over a 151,936-wide vocabulary (the
            # sampler's cumsum) fails to generate code in torch 2.11
            self._decoder = Decoder(model, compile=compile, fused=self.fused, attention=self.attention)
            self.free()
        return self._decoder

    def _decode(
        self, dec: Decoder, ids: Tensor, mask: Tensor, seeds: Tensor, sp: SamplingParams, offsets: Tensor
    ) -> tuple[Tensor, Tensor, int]:
        """One batch: prefill, then decode steps. Returns (tokens [B, T], log-probs [B, T], steps run)."""
        B, P = ids.shape
        T = sp.max_new_tokens
        run = self._run_for(dec, B, P, T)
        graphs, fixed = self._graphs_on(dec.model), self._fixed_shapes(dec.model)
        key = (sp.temperature, sp.top_k, sp.top_p, sp.greedy)
        dev_type = ids.device.type
        autocast = torch.is_autocast_enabled(dev_type)
        with torch.autocast(dev_type, dtype=torch.get_autocast_dtype(dev_type), enabled=autocast, cache_enabled=False):
            if graphs:
                self._ensure_graphs(dec, run, sp, key)
            run.n_prompt.copy_(mask.sum(1))
            run.key_ok[:, :P].copy_(mask.bool())
            run.seeds.copy_(seeds)
            run.offsets.copy_(offsets)
            run.out_tok.fill_(self.pad_id)
            run.out_lp.zero_()
            run.done.zero_()
            run.step.zero_()
            logits = self._prefill_shared(dec, run, ids, mask)
            self._emit(run, logits, sp)  # token 0, from the prompt's last position
            n = 1
            while n < T:
                if n % self.check_every == 0 and bool(run.done.all()):
                    break
                j = (n - 1) // self.bucket
                if graphs:
                    run.graphs[key + (j,)].replay()
                else:
                    self._step(dec, run, self._bucket_len(run, j) if fixed else run.P + n, sp)
                n += 1
        return run.out_tok.clone(), run.out_lp.clone(), n

    def _prefill_shared(self, dec: Decoder, run: _Run, ids: Tensor, mask: Tensor) -> Tensor:
        """Prefill each distinct prompt row once (a GRPO group's G copies of a prompt, the K Monte-Carlo
        continuations of one prefix) into the first rows of the cache, then copy its keys and values to the rows
        that repeat it. Returns every row's last-position logits [B, V]. The prefix is computed for fewer rows, so
        its digits may differ from a full-batch prefill by float rounding (kernels picked by batch size)."""
        B, P = ids.shape
        uniq, inverse = torch.unique(torch.cat([ids, mask.long()], 1), dim=0, return_inverse=True)
        U = uniq.shape[0]
        self._prefill_rows[0] += B
        self._prefill_rows[1] += U
        if U == B:
            return dec.prefill(ids, mask, run.cache)
        head = KVCache([k[:U] for k in run.cache.keys], [v[:U] for v in run.cache.values])  # views: written in place
        logits = dec.prefill(uniq[:, :P], uniq[:, P:], head)
        for k, v in zip(run.cache.keys, run.cache.values):
            k[:, :, :P].copy_(k[:U, :, :P][inverse])
            v[:, :, :P].copy_(v[:U, :, :P][inverse])
        return logits[inverse]

    def _bucket_len(self, run: _Run, j: int) -> int:
        return run.P + min((j + 1) * self.bucket, run.T)

    def _run_for(self, dec: Decoder, B: int, P: int, T: int) -> _Run:
        dev = dec.head.weight.device
        key = (B, P, T, dev)  # (a policy moved between devices, as Lightning's teardown does, gets new buffers)
        run = self._runs.get(key)
        if run is None:
            self.free()  # one shape's buffers at a time: multi-turn calls vary the shape
            lng = dict(dtype=torch.long, device=dev)
            run = _Run(P=P, T=T, cache=dec.new_cache(B, P + T), tok=torch.zeros(B, **lng), step=torch.zeros((), **lng),
                       n_prompt=torch.zeros(B, **lng), key_ok=torch.ones(B, P + T, dtype=torch.bool, device=dev),
                       seeds=torch.zeros(B, **lng), offsets=torch.zeros(B, **lng), out_tok=torch.zeros(B, T, **lng),
                       out_lp=torch.zeros(B, T, dtype=torch.float32, device=dev),
                       done=torch.zeros(B, dtype=torch.bool, device=dev),
                       stops=torch.tensor(self.stop_ids, **lng))
            self._runs[key] = run
        return run

    def _emit(self, run: _Run, logits: Tensor, sp: SamplingParams) -> None:
        """Sample token ``run.step`` from logits [B, V], record it, advance the step (no host sync)."""
        step = run.step + run.offsets
        if self.sampler == "fused" and not (sp.greedy or sp.top_k or sp.top_p < 1.0):
            tok, lp = fused_draw(logits, row_uniforms(run.seeds, step), sp.temperature)
        else:
            tok, lp = sample_rows(logits, run.seeds, step, temperature=sp.temperature, top_k=sp.top_k,
                                  top_p=sp.top_p, greedy=sp.greedy)
        tok = torch.where(run.done, self.pad_id, tok)
        lp = lp.masked_fill(run.done, 0.0)
        at = run.step.reshape(1)
        run.out_tok.index_copy_(1, at, tok[:, None])
        run.out_lp.index_copy_(1, at, lp[:, None])
        run.done |= (tok[:, None] == run.stops[None]).any(-1)
        run.tok.copy_(tok)
        run.step.add_(1)

    def _step(self, dec: Decoder, run: _Run, length: int, sp: SamplingParams) -> None:
        """Decode one token for every row: feed ``run.tok`` (cache position P + step - 1), sample token ``step``."""
        self._emit(run, self._step_logits(dec, run, length), sp)

    def _step_logits(self, dec: Decoder, run: _Run, length: int) -> Tensor:
        """The forward of one decode step: ``run.tok`` at cache position P + step - 1 → logits [B, V]."""
        at = run.P + run.step - 1
        pos = (run.n_prompt + run.step - 1)[:, None]
        visible = run.key_ok[:, :length] & (torch.arange(length, device=at.device) <= at)
        hidden = dec.forward(run.tok[:, None], pos, run.cache, at.reshape(1), length, visible[:, None, None, :])
        if self.sampler == "fused":  # the head's own dtype: the draw reads it once (no float32 copy of [B, V])
            return dec.head(hidden)
        return dec.logits(hidden)

    def _ensure_graphs(self, dec: Decoder, run: _Run, sp: SamplingParams, key: tuple) -> None:
        """Capture the decode step of every bucket for this shape and sampling setting (once; again if the
        weights' storage moved, as a re-gathered FSDP policy's does)."""
        weights = tuple(p.data_ptr() for p in dec.model.parameters())
        if weights != run.weights:
            run.graphs.clear()
            self._pool = None  # (see free: no new captures into the pool of freed graphs)
            run.weights = weights
        n_buckets = -(-max(1, run.T - 1) // self.bucket)
        if all(key + (j,) in run.graphs for j in range(n_buckets)):
            return
        t0 = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        for j in range(n_buckets):
            length = self._bucket_len(run, j)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture (library handles, compiled kernels)
                for _ in range(2):
                    run.step.fill_(1)
                    self._step(dec, run, length, sp)
            torch.cuda.current_stream().wait_stream(side)
            run.step.fill_(1)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._step(dec, run, length, sp)
            run.graphs[key + (j,)] = graph
            self._captured += 1
        torch.cuda.synchronize()
        self._capture_s += time.perf_counter() - t0
