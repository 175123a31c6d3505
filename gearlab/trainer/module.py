"""The GRPO recipe as a LightningModule (manual optimisation).

One ``training_step`` = one RL iteration:
rollout → rewards → group advantages → signals the assigner declared → token advantages →
``ppo_epochs × mini_batches`` optimizer steps, each accumulated over micro-batches with the loss
normalised by the GLOBAL token/sequence count of the optimizer step (all micro-batches, all ranks).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import time
import zlib
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

from gearlab.core import grpo
from gearlab.core.batch import RolloutBatch
from gearlab.config import Config
from gearlab.credit import CreditAssigner, CreditOutput, Signal
from gearlab.signals.registry import needs_resampler
from gearlab.credit.diagnostics import credit_diagnostics
from gearlab.parallel.distributed import (all_reduce_sum, gather_rows, gathered_for_generation, global_max_int,
                                          is_fsdp1)
from gearlab.core.logprobs import response_hidden, token_logprobs
from gearlab.core.metrics import pass_at_k
from gearlab.core.sdpa import differentiable_attention
from gearlab.rollout.base import SamplingParams, step_seed
from gearlab.rollout.factory import engine_from_config
from gearlab.signals.provider import SignalProvider
from gearlab.trainer.batching import micro_batches, tiled_mini_batches
from gearlab.trainer.schedule import lr_factor
from gearlab.trainer.teacher import Teacher, needs_teacher
from gearlab.tasks.base import Task


log = logging.getLogger("gearlab")


class NonFiniteLossError(RuntimeError):
    pass


class GRPOModule(L.LightningModule):
    def __init__(self, cfg: Config, policy: nn.Module, tokenizer: Any, task: Task, assigner: CreditAssigner) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.cfg = cfg
        self.policy = policy.train()  # from_pretrained returns eval mode
        if cfg.trainer.activation_checkpointing:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.tokenizer = tokenizer
        self.task = task
        self.assigner = assigner
        self.ref_policy: nn.Module | None = None
        self.ref_signals: SignalProvider | None = None
        if cfg.algorithm.kl_coef > 0:
            self.ref_policy = copy.deepcopy(policy).eval().requires_grad_(False)
            self.ref_signals = SignalProvider(self.ref_policy, temperature=cfg.rollout.temperature,
                                              chunk_size=cfg.signals.chunk_size,
                                              micro_batch_size=cfg.algorithm.micro_batch_size,
                                              packed=cfg.algorithm.packed, compiled=cfg.trainer.compile,
                                              crop=cfg.algorithm.crop_padding)
        self.engine = engine_from_config(tokenizer, task, cfg, training=True, model=policy)
        self.generator = self.engine.generator  # None: HF generate on the policy; else e.g. a colocated vLLM engine
        self.signals = SignalProvider(policy, temperature=cfg.rollout.temperature, chunk_size=cfg.signals.chunk_size,
                                      micro_batch_size=cfg.algorithm.micro_batch_size, tokenizer=tokenizer,
                                      packed=cfg.algorithm.packed, compiled=cfg.trainer.compile,
                                      crop=cfg.algorithm.crop_padding)
        self.teacher = Teacher(policy, assigner)
        self.sampling = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                                       top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)
        self.iterations_done = 0
        self.interrupted = False  # set by a signal handler (gearlab.trainer.train.RunStop): stop at the next boundary
        self.nonfinite_streak = 0
        self.no_signal_streak = 0  # consecutive iterations in which every group's rewards were equal
        self.totals = {"nonfinite_steps": 0, "reward_errors": 0, "generated_tokens": 0, "no_signal_iterations": 0}

    # -- Lightning plumbing -------------------------------------------------------------------
    def configure_model(self) -> None:
        """FSDP2 (``ModelParallelStrategy``): shard the policy and any frozen copy (reference, teacher)
        over the data-parallel mesh; FSDP1: wrap them; ``trainer.compile``: compile their decoder layers.
        Called by Lightning once per process, before the optimizers."""
        if self.cfg.trainer.compile:  # after the copies were made (a deepcopy would share compiled methods)
            from gearlab.parallel.compiling import compile_decoder_layers

            for m in (self.policy, self.ref_policy, self.teacher.copy):
                if m is not None:
                    compile_decoder_layers(m)
        if getattr(self, "_sharded", False):
            return
        from lightning.pytorch.strategies import FSDPStrategy

        if self._trainer is not None and isinstance(self.trainer.strategy, FSDPStrategy):
            self._wrap_fsdp1()
            return
        mesh = getattr(self, "_device_mesh", None)
        if mesh is None:
            return
        from gearlab.parallel.distributed import shard_fsdp2

        # trainer.precision=bf16-mixed: the matrices gathered in bf16 (what autocast computes with), fp32 gradient
        # reduction, master weights in the loaded dtype; also on the CPU, where autocast is bf16 too
        bf16 = self.cfg.trainer.precision.startswith("bf16")
        models = [m for m in (self.policy, self.ref_policy, self.teacher.copy) if m is not None]
        shard_fsdp2(models, mesh["data_parallel"], bf16=bf16, cpu_offload=self.cfg.trainer.cpu_offload)
        self._sharded = True
        self.engine.synced_gpus = mesh["data_parallel"].size() > 1  # every rank steps generate() together

    def _wrap_fsdp1(self) -> None:
        """FSDP1 (trainer.strategy=fsdp1): wrap the policy and any frozen copy, and point every holder of
        the policy (signals, teacher) at the wrapper — FSDP1 wraps, where FSDP2 shards in place."""
        from gearlab.parallel.distributed import wrap_fsdp1

        bf16 = self.cfg.trainer.precision.startswith("bf16")
        dev = self.trainer.strategy.root_device  # (the module itself is still on the CPU here)
        self.policy = wrap_fsdp1(self.policy, dev, bf16=bf16)
        self.signals.model = self.policy
        self.teacher.policy = self.policy
        if self.teacher.copy is not None:
            self.teacher.copy = wrap_fsdp1(self.teacher.copy, dev, bf16=bf16)
        if self.ref_policy is not None:
            self.ref_policy = wrap_fsdp1(self.ref_policy, dev, bf16=bf16)
            self.ref_signals.model = self.ref_policy
        self._sharded = True
        self.engine.synced_gpus = self.trainer.world_size > 1

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return batch  # prompts are Python objects; tensors are made on the right device later

    def configure_optimizers(self):
        o = self.cfg.optim
        # fused: one kernel, the same digits on every CPU class (the foreach form's square root is not)
        opt = torch.optim.AdamW(self.policy.parameters(), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay,
                                fused=True)
        total = self.cfg.trainer.max_steps * self.cfg.algorithm.ppo_epochs * self.cfg.algorithm.mini_batches
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_factor(s, total, o.warmup_steps, o.schedule, o.min_lr_ratio)
        )
        return [opt], [sched]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["gearlab"] = {"iterations_done": self.iterations_done, "nonfinite_streak": self.nonfinite_streak,
                                 "no_signal_streak": self.no_signal_streak, "totals": dict(self.totals),
                                 "assigner": self.assigner.state_dict(),
                                 "teacher": self.teacher.state_dict(), "config": _to_container(self.cfg)}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        st = checkpoint.get("gearlab", {})
        self.iterations_done = st.get("iterations_done", 0)
        self.nonfinite_streak = st.get("nonfinite_streak", 0)
        self.no_signal_streak = st.get("no_signal_streak", 0)
        self.totals.update(st.get("totals", {}))
        self.assigner.load_state_dict(st.get("assigner", {}))
        self.teacher.load_state_dict(st.get("teacher"))

    # -- one RL iteration ---------------------------------------------------------------------
    def _resampler(self, rb: RolloutBatch, problems: list) -> Any:
        """What continues this batch's responses from their prefixes, when the assigner asks for a Monte-Carlo
        signal (gearlab.signals.mc); else None."""
        if not needs_resampler(self.assigner.needs):
            return None
        from gearlab.rollout.mc import resampler_of_groups

        return resampler_of_groups(self.engine, self.policy, rb, problems, self.cfg.rollout.group_size, self.sampling)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        it = batch["iteration"]
        rank = self.trainer.global_rank if self._trainer is not None else 0
        # row i of this rank is global row rank·B + i: its sampling seed (every engine draws row j of a call with
        # seed + j) and its group id, hence the whole run, do not depend on how many ranks share the batch
        first_row = rank * len(batch["problems"]) * self.cfg.rollout.group_size
        t0 = time.perf_counter()
        rb, all_rewards, all_groups, all_seq_adv = self._rollout(batch["problems"], it, rank, first_row)
        seq_adv = all_seq_adv[first_row : first_row + rb.batch_size]

        t1 = time.perf_counter()
        alg = self.cfg.algorithm
        on_policy = alg.ppo_epochs == 1 and alg.mini_batches == 1
        in_forward = self._entropy_in_forward(on_policy)
        resampler = None if in_forward else self._resampler(rb, batch["problems"])
        rb, credit = self._signals_and_credit(rb, seq_adv, it, first_row, on_policy, in_forward, resampler)
        adv = None if credit is None else credit.token_advantages
        loss_mask = rb.response_mask if credit is None or credit.loss_mask is None else (
            credit.loss_mask.bool() & rb.response_mask)

        t2 = time.perf_counter()
        with differentiable_attention():  # cuDNN's attention backward is wrong on some masked inputs (core/sdpa.py)
            upd = self._update(rb, adv, loss_mask, it, seq_adv=seq_adv if in_forward else None)
        if in_forward:
            credit, upd["signals/entropy_in_forward"] = self._forward_credit, 1.0
            adv = credit.token_advantages
        # the method's own diagnostics (their mean over ranks), then the same statistics for every method over the
        # global batch (the core's, not the assigner's)
        credit.metrics = {**self._rank_mean(credit.metrics),
                          **credit_diagnostics(gather_rows(adv), all_seq_adv,
                                               gather_rows(rb.response_mask.float()) > 0,
                                               gather_rows(loss_mask.float()) > 0)}
        if self.generator is not None:
            self.generator.mark_stale()  # the next rollout first syncs the new weights into the engine
            upd.update(self.generator.stats())
        t3 = time.perf_counter()
        upd.update({"time_rollout_s": t1 - t0, "time_signals_credit_s": t2 - t1, "time_update_s": t3 - t2})
        if resampler is not None:  # what the Monte-Carlo continuations cost, summed over ranks (seconds: compute)
            keys = sorted(resampler.cost)
            total = all_reduce_sum(torch.tensor([float(resampler.cost[k]) for k in keys], device=self.device)).cpu()
            upd.update({f"mc/{k}": float(v) for k, v in zip(keys, total)})
        if self.cfg.trainer.compile:  # graphs compiled so far by this process: still growing late = recompiling
            from torch._dynamo.utils import counters

            upd["compile/graphs_total"] = float(counters["stats"]["unique_graphs"])
        self._end_iteration(it)
        upd["data_crc"] = float(zlib.crc32("\x00".join(p.prompt for p in batch["problems"]).encode()) % 1_000_000)
        upd["rollout_crc"] = self._rollout_crc(rb)
        self._log_iteration(rb, all_rewards, all_groups, all_seq_adv, credit.metrics, upd)

    def _rollout_crc(self, rb: RolloutBatch) -> float:
        """A fingerprint of the iteration's sampled tokens over all ranks: the sum of each response's crc32 (its
        tokens up to its own length, so neither a rank's padding width nor the split of rows over ranks changes it),
        mod 10^6. Children of one seed in a comparison must agree at iteration 0 (``gearlab report``'s pairing
        line)."""
        ids, mask = rb.response_ids.cpu(), rb.attention_mask.bool().cpu()
        local = sum(zlib.crc32(ids[i][mask[i]].numpy().tobytes()) for i in range(ids.shape[0]))
        total = all_reduce_sum(torch.tensor([float(local)], dtype=torch.float64, device=self.device))  # < 2^53: exact
        return float(int(total.item()) % 1_000_000)

    def _rollout(self, problems: list, it: int, rank: int,
                 first_row: int) -> tuple[RolloutBatch, Tensor, Tensor, Tensor]:
        """This rank's rollout of ``problems`` (G responses each) on the module's device, and the rewards [N], group
        ids [N] and sequence advantages [N] of the GLOBAL batch (N rows over all ranks): every rank computes all of
        them, so a group's statistics, std_scope=batch's std and every logged reward statistic are those of all
        rows, whatever the world size."""
        cfg, alg = self.cfg, self.cfg.algorithm
        # HF generate on a sharded policy: gather the weights once, not once per token (another engine holds its own
        # copy)
        with gathered_for_generation(self.policy) if self.generator is None else contextlib.nullcontext():
            rb = self.engine.generate(self.policy, problems, group_size=cfg.rollout.group_size,
                                      sampling=self.sampling, seed=step_seed(cfg.trainer.seed, it) + first_row,
                                      with_teacher=self.assigner.teacher_context if needs_teacher(
                                          self.assigner
                                      ) else False,
                                      group_offset=rank * len(problems))
        if self.generator is not None:
            self.generator.release()  # e.g. vLLM sleeps: its GPU memory goes back to the update
        rb = rb.to(self.device)
        all_rewards, all_groups = gather_rows(rb.rewards), gather_rows(rb.group_ids)
        all_seq_adv = grpo.group_advantages(all_rewards, all_groups, scale_by_std=alg.scale_by_std,
                                            eps=alg.adv_eps, leave_one_out=alg.leave_one_out, std_scope=alg.std_scope)
        return rb, all_rewards, all_groups, all_seq_adv

    def _signals_and_credit(self, rb: RolloutBatch, seq_adv: Tensor, it: int, first_row: int, on_policy: bool,
                            in_forward: bool, resampler: Any) -> tuple[RolloutBatch, CreditOutput | None]:
        """The signals the assigner declared and its token advantages, before the update: the batch (with the old
        and reference log-probs where the update needs them) and the checked credit. ``in_forward``: the credit is
        assigned inside the update instead (None returned)."""
        ppass, signals = None, {}
        skip = self.cfg.signals.skip_zero_rows and self.assigner.ignores_zero_rows
        if not in_forward:
            ppass, signals = self.signals.compute(rb, self.assigner.needs, with_logprobs=not on_policy,
                                                  teacher=self.teacher.model,
                                                  options={"seed": step_seed(self.cfg.trainer.seed, it),
                                                           "first_row": first_row, **self.assigner.signal_options()},
                                                  resampler=resampler, rows=seq_adv != 0 if skip else None)
        if ppass is not None:
            rb = rb.with_(old_logprobs=ppass.logprobs)
        if self.ref_signals is not None:
            rb = rb.with_(ref_logprobs=self.ref_signals.compute(rb, frozenset())[0].logprobs)
        if in_forward:
            return rb, None
        credit = self.assigner.assign(rb, seq_adv, signals)
        credit.token_advantages = self._checked(credit.token_advantages, rb)
        return rb, credit

    def _end_iteration(self, it: int) -> None:
        """Count the iteration, ask Lightning to stop after it when a stop was requested on any rank, and tell the
        assigner and the teacher it ended."""
        cfg = self.cfg
        self.iterations_done = it + 1
        self.session_iterations = getattr(self, "session_iterations", 0) + 1
        # a stop request (trainer.stop_after, trainer.deadline, or Ctrl-C / SIGTERM caught by gearlab.trainer.train)
        # ends the run at this iteration boundary; every rank must agree, or the ranks' collectives would no longer
        # match
        stop = (0 < cfg.trainer.stop_after <= self.session_iterations or self.interrupted
                or 0 < cfg.trainer.deadline <= time.time())
        if global_max_int(int(stop), self.device) and self.iterations_done < cfg.trainer.max_steps:
            self.stopped_early = True
            self.trainer.should_stop = True  # after this iteration's checkpoint (IterationCheckpoint saves it)
        self.assigner.on_step_end(self.iterations_done)
        self.teacher.after_iteration(self.iterations_done)

    def _entropy_in_forward(self, on_policy: bool) -> bool:
        """Whether this iteration's credit takes the policy's entropy from the update's forward (one pass fewer):
        on-policy, the method needs nothing else, and it can be assigned micro-batch by micro-batch in order."""
        alg = self.cfg.algorithm
        return (self.cfg.signals.entropy_in_forward and on_policy and alg.micro_batch_tokens == 0
                and set(self.assigner.needs) == {Signal.ENTROPY} and self.assigner.chunk_local(alg.micro_batch_size))

    def _checked(self, adv: Tensor, rb: RolloutBatch) -> Tensor:
        adv = adv.to(self.device).float()
        if adv.shape != rb.response_ids.shape:
            raise ValueError(
                f"assigner {self.assigner.name!r} returned advantages {tuple(adv.shape)}, expected "
                f"{tuple(rb.response_ids.shape)}"
            )
        return adv

    def _update(
        self, rb: RolloutBatch, adv: Tensor | None, loss_mask: Tensor, it: int, seq_adv: Tensor | None = None
    ) -> dict[str, float]:
        """ppo_epochs × mini_batches optimizer steps over the rollout; returns the diagnostics of all of them.

        The mini-batches and their micro-batches partition the GLOBAL batch (rows of all ranks, rank order;
        ``tiled_mini_batches``), so mini-batch k holds the same rows whatever the number of ranks; each rank trains
        its own rows of it (maybe none: it then runs empty passes so that the ranks' collectives still pair up). A
        non-finite loss or gradient on any rank skips the optimizer step on every rank (one all-reduced flag).
        adv None (with ``seq_adv`` [B]): the credit is assigned inside the update, each micro-batch from the entropy
        of its own forward (``_entropy_in_forward``); the advantages and the method's metrics (averaged over
        micro-batches) are left in ``self._forward_credit``."""
        alg = self.cfg.algorithm
        if adv is None:
            adv = torch.zeros(rb.response_ids.shape, device=self.device)
        credit_logs: dict[str, list[float]] = {}  # with seq_adv: the method's metrics, micro-batch by micro-batch
        B = rb.batch_size
        world = self.trainer.world_size if self._trainer is not None else 1
        first = (self.trainer.global_rank if self._trainer is not None else 0) * B
        crop = alg.crop_padding if alg.crop_padding is not None else self.device.type == "cuda"
        sums: dict[str, Tensor] = {}  # metric → [Σ value·weight, Σ weight] over every micro-batch of every step
        grad_norms: list[float] = []
        for epoch in range(alg.ppo_epochs):
            g = torch.Generator().manual_seed(step_seed(self.cfg.trainer.seed, it, 10_000 + epoch))
            plan = tiled_mini_batches(B * world, alg.mini_batches, alg.micro_batch_size, g)
            for m in range(alg.mini_batches):
                self._mini_batch_step(rb, adv, loss_mask, plan[m], first, crop, sums, grad_norms, seq_adv,
                                      credit_logs)
        if seq_adv is not None:
            self._forward_credit = CreditOutput(
                token_advantages=adv, metrics={k: sum(v) / len(v) for k, v in credit_logs.items()}
            )
        return self._update_metrics(sums, grad_norms, alg.ppo_epochs * alg.mini_batches, world)

    def _mini_batch_step(self, rb: RolloutBatch, adv: Tensor, loss_mask: Tensor, tiles: list[Tensor], first: int,
                         crop: bool, sums: dict[str, Tensor], grad_norms: list[float], seq_adv: Tensor | None,
                         credit_logs: dict[str, list[float]]) -> None:
        """One optimizer step over one mini-batch of the global batch (``tiles``: its micro-batches' global row
        indices): this rank's rows' forward/backward passes, padded with empty passes to the ranks' largest count,
        then the step unless a loss or gradient was non-finite on any rank. Accumulates the metrics into ``sums``
        ([Σ value·weight, Σ weight]) and the clipped gradient norm into ``grad_norms``; with ``seq_adv`` the credit
        of each micro-batch is assigned from its own forward into ``adv`` (``credit_logs`` its metrics)."""
        alg = self.cfg.algorithm
        opt, sched, B = self.optimizers(), self.lr_schedulers(), rb.batch_size
        # this rank's rows of the mini-batch, in local indices, micro-batch by micro-batch
        mine = [(t[(t >= first) & (t < first + B)] - first).to(self.device) for t in tiles]
        mine = [t for t in mine if t.numel()]
        idx = torch.cat(mine) if mine else torch.zeros(0, dtype=torch.long, device=self.device)
        # clamp: a mini-batch with no selected token has a zero loss, not 0/0
        counts = {name: (self._global_sum(mk[idx].sum().float()).clamp_min(1),
                         self._global_sum((mk[idx].sum(-1) > 0).sum().float()).clamp_min(1))
                  for name, mk in (("pg", loss_mask), ("full", rb.response_mask))}
        opt.zero_grad(set_to_none=True)
        finite = torch.ones((), device=self.device)
        chunks = micro_batches(  # a token budget forms its own micro-batches; else the plan's tiles
            idx, rb.full_attention_mask().sum(-1)[idx], alg.micro_batch_size, alg.micro_batch_tokens
        ) if idx.numel() and alg.micro_batch_tokens > 0 else mine
        # sharded ranks must run the same number of forward/backward passes: pad with empty ones
        n_max = global_max_int(len(chunks), self.device)
        for j in range(n_max):
            empty = j >= len(chunks)
            mi = torch.zeros(1, dtype=torch.long, device=self.device) if empty else chunks[j]
            mb = rb.select(mi)
            mb = mb.cropped() if crop else mb  # this micro-batch's own widths: no compute on shared padding
            w = mb.response_len
            mask_j = torch.zeros_like(loss_mask[mi, :w]) if empty else loss_mask[mi, :w]
            hook = None
            if seq_adv is not None and not empty:
                def hook(mb: RolloutBatch, ent: Tensor, mi: Tensor = mi, w: int = w) -> Tensor:
                    out = self.assigner.assign(mb, seq_adv[mi], {Signal.ENTROPY: ent})
                    if out.loss_mask is not None:
                        raise ValueError(
                            f"assigner {self.assigner.name!r} declared chunk_local but returned a loss mask"
                        )
                    adv[mi, :w] = self._checked(out.token_advantages, mb).detach()
                    for k, v in out.metrics.items():
                        credit_logs.setdefault(k, []).append(float(v))
                    return adv[mi, :w]
            loss, metrics = self._micro_loss(mb, adv[mi, :w], mask_j, counts, assign=hook)
            weight = 0.0 if empty else float(rb.response_mask[mi].sum())
            if empty:
                loss = loss * 0.0  # takes part in the collectives, contributes nothing
            if not torch.isfinite(loss):
                # no break: every rank must run the same passes (FSDP's collectives); this one contributes
                # nothing and the whole step is skipped below
                finite.zero_()
                loss = torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0) * 0.0
            self.manual_backward(loss)
            for k, v in metrics.items():
                w = 1.0 if k in _LOSS_TERMS else weight  # loss terms: already shares of the global value
                acc = sums.setdefault(k, torch.zeros(2, dtype=torch.float64))
                acc += torch.tensor([0.0 if empty else float(v) * w, w], dtype=torch.float64)
        self._step_if_finite(opt, sched, finite, grad_norms)

    def _step_if_finite(self, opt: Any, sched: Any, finite: Tensor, grad_norms: list[float]) -> None:
        """One optimizer step on the accumulated gradients, clipped (their norm appended to ``grad_norms``), unless
        the loss (``finite`` 0) or a gradient is non-finite on any rank: then every rank skips it together."""
        if bool(finite) and not _grads_finite(self.policy):
            finite.zero_()
        if self._global_sum(1.0 - finite) > 0:  # every rank skips together
            opt.zero_grad(set_to_none=True)
            self._on_nonfinite()
            return
        self.nonfinite_streak = 0
        if self.cfg.optim.grad_clip > 0:
            if is_fsdp1(self.policy):  # the norm over all shards (FSDP1's flat parameters are local)
                gn = self.policy.clip_grad_norm_(self.cfg.optim.grad_clip)
            else:
                gn = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.cfg.optim.grad_clip)
            grad_norms.append(float(gn))
        opt.step()
        sched.step()

    def _update_metrics(self, sums: dict[str, Tensor], grad_norms: list[float], steps: int,
                        world: int) -> dict[str, float]:
        """The update's logged values, global: a loss term (pg_loss, kl, entropy_bonus) is the mean over optimizer
        steps of its global value (its micro-batch shares summed over micro-batches and ranks; each share carries
        the factor dp_size of verl's convention, divided out here); any other metric (clip fractions, ratios) is
        its mean over every generated token of the update. Every rank calls it (one all-reduce)."""
        keys = sorted(sums)
        if not keys:
            return {"grad_norm": sum(grad_norms) / len(grad_norms)} if grad_norms else {}
        total = all_reduce_sum(torch.stack([sums[k] for k in keys]).to(self.device)).cpu()
        out = {}
        for k, (v, w) in zip(keys, total.tolist()):
            out[k] = v / world / steps if k in _LOSS_TERMS else (v / w if w > 0 else 0.0)
        if grad_norms:
            out["grad_norm"] = sum(grad_norms) / len(grad_norms)
        return out

    def _rank_mean(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each metric's mean over the ranks that report it (the metrics themselves with one process). Every rank
        calls it; a method may report a metric on some ranks only (OAR's weight statistics need a credited response
        with reasoning among the rank's rows), so the ranks first agree on the union of the keys and their sums
        always match."""
        world = self.trainer.world_size if self._trainer is not None else 1
        if world == 1:
            return metrics
        import torch.distributed as dist

        names: list[list[str] | None] = [None] * world
        dist.all_gather_object(names, sorted(metrics))
        keys = sorted(set().union(*names))
        if not keys:
            return {}
        pairs = [x for k in keys for x in (float(metrics.get(k, 0.0)), float(k in metrics))]  # (value, reported)
        total = all_reduce_sum(torch.tensor(pairs, device=self.device)).view(-1, 2).tolist()
        return {k: v / n for k, (v, n) in zip(keys, total) if n > 0}

    def loss_scale_factor(self) -> float:
        """The constant of ``agg=seq-mean-token-sum-norm`` (Dr.GRPO): ``algorithm.loss_scale_factor``, by default the
        response budget (``rollout.max_new_tokens``; multi-turn: the episode's token budget) — not the padded width
        of a micro-batch, which moves with each batch's longest response and with the number of ranks."""
        if self.cfg.algorithm.loss_scale_factor is not None:
            return float(self.cfg.algorithm.loss_scale_factor)
        eng = self.engine
        if hasattr(eng, "max_turns"):  # the multi-turn engine
            return float(eng.max_total_tokens or self.cfg.rollout.max_new_tokens * eng.max_turns)
        return float(self.cfg.rollout.max_new_tokens)

    def _micro_loss(self, mb: RolloutBatch, adv: Tensor, mask: Tensor, counts: dict[str, tuple[Tensor, Tensor]],
                    assign: Any = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Loss of one micro-batch, already divided by the global counts: the policy-gradient term over
        the assigner's loss mask, KL and entropy bonus over every generated token (as verl / the 80/20 code).
        ``assign``: a function (micro-batch, entropy [b, T] detached) → advantages [b, T], called between the forward
        and the loss (in-forward credit); then ``adv`` is ignored."""
        alg = self.cfg.algorithm
        dp = self.trainer.world_size if self._trainer is not None else 1
        lsf = self.loss_scale_factor()
        pg_counts = dict(global_tokens=counts["pg"][0], global_seqs=counts["pg"][1], loss_scale_factor=lsf, dp_size=dp)
        full_counts = dict(global_tokens=counts["full"][0], global_seqs=counts["full"][1], loss_scale_factor=lsf,
                           dp_size=dp)
        hidden = response_hidden(self.policy, mb.input_ids(), mb.full_attention_mask(), mb.prompt_ids.shape[1],
                                 mb.response_len,
                                 packed=alg.packed)
        logp, ent = token_logprobs(hidden, self.policy.get_output_embeddings(), mb.response_ids,
                                   temperature=self.cfg.rollout.temperature, chunk_size=self.cfg.signals.chunk_size,
                                   with_entropy=alg.entropy_coef > 0 or assign is not None,
                                   compiled=self.cfg.trainer.compile)
        if assign is not None:
            adv = assign(mb, ent.detach().float())
        old = mb.old_logprobs if mb.old_logprobs is not None else logp.detach()
        is_w, mismatch = None, {}
        if mb.rollout_logprobs is not None:  # sampled by another engine (vLLM): its log-probs vs the trainer's
            is_w, mismatch = grpo.engine_mismatch(old, mb.rollout_logprobs, mb.response_mask, alg.engine_is,
                                                    cap=alg.engine_is_cap, low=alg.engine_is_low)
        loss, metrics = grpo.policy_loss(logp, old, adv, mask, clip_low=alg.clip_low, clip_high=alg.clip_high,
                                         dual_clip=alg.dual_clip, agg=alg.agg, is_weights=is_w, **pg_counts)
        metrics = dict(metrics, pg_loss=loss.detach(), **mismatch)
        if alg.kl_coef > 0:
            kl = grpo.aggregate(
                grpo.kl_penalty(logp, mb.ref_logprobs, alg.kl_kind), mb.response_mask, alg.agg, **full_counts
            )
            loss = loss + alg.kl_coef * kl
            metrics["kl"] = kl.detach()
        if alg.entropy_coef > 0:
            eb = grpo.aggregate(ent, mb.response_mask, alg.agg, **full_counts)
            loss = loss - alg.entropy_coef * eb
            metrics["entropy_bonus"] = eb.detach()
        return loss, metrics

    def _global_sum(self, x: Tensor | float) -> Tensor:
        t = torch.as_tensor(x, dtype=torch.float32, device=self.device)
        if self._trainer is None or self.trainer.world_size == 1:
            return t
        return self.trainer.strategy.reduce(t.clone(), reduce_op="sum")

    def _on_nonfinite(self) -> None:
        self.nonfinite_streak += 1
        self.totals["nonfinite_steps"] += 1
        if self.nonfinite_streak >= self.cfg.trainer.max_nonfinite:
            raise NonFiniteLossError(
                f"{self.nonfinite_streak} consecutive optimizer steps had a non-finite loss; stopping "
                f"(the last good checkpoint is kept)")

    # -- metrics --------------------------------------------------------------------------------
    def _log_iteration(self, rb: RolloutBatch, rewards: Tensor, group_ids: Tensor, seq_adv: Tensor,
                       credit_metrics: dict[str, float], upd: dict[str, float]) -> None:
        """Log one iteration. rewards, group_ids, seq_adv [B_global]: the global batch's (rank order), so every
        value logged is the global one whatever the number of ranks."""
        G = self.cfg.rollout.group_size
        correct = (rewards >= 1.0 - 1e-6).float()
        reward, acc = rewards.float().mean(), correct.mean()
        pk = pass_at_k(correct.view(-1, G).sum(-1), G, G).float().mean()
        self.totals["reward_errors"] += int(self._global_sum(float(rb.meta.get("reward_errors", 0))))
        gen_tokens = int(self._global_sum(rb.attention_mask.sum().float()))
        self.totals["generated_tokens"] += gen_tokens
        self.log("reward", reward, prog_bar=True, on_step=True, logger=False)
        self.log("acc", acc, prog_bar=True, on_step=True, logger=False)
        lens = gather_rows(rb.response_mask.sum(-1).float())
        frac_zero_std = grpo.zero_std_fraction(rewards, group_ids)
        self._check_signal(rb, rewards, frac_zero_std, float(reward), credit_metrics)
        out = {
            "train/reward": reward, "train/accuracy": acc, f"train/pass_at_{G}": pk,
            "train/frac_zero_std": frac_zero_std,
            "train/no_signal_iterations_total": float(self.totals["no_signal_iterations"]),
            "train/response_len": lens.mean(), "train/adv_abs_mean": seq_adv.abs().mean(),
            "train/iteration": float(self.iterations_done), "train/lr": self.lr_schedulers().get_last_lr()[0],
            "train/generated_tokens_total": float(self.totals["generated_tokens"]),
            "train/nonfinite_steps_total": float(self.totals["nonfinite_steps"]),
            "train/reward_errors_total": float(self.totals["reward_errors"]),
        }
        # fingerprints of the iteration's prompts and sampled tokens: paired runs agree (the tokens at iteration 0)
        out["train/data_crc"], out["train/rollout_crc"] = upd.pop("data_crc"), upd.pop("rollout_crc")
        out.update(
            {(
                k if "/" in k else f"time/{k[5:]}" if k.startswith("time_") else f"update/{k}"
            ): v for k, v in upd.items()}
        )
        out.update({f"credit/{k}": v for k, v in credit_metrics.items()})
        # multi-turn: tool use, ends
        out.update({f"rollout/{k}": v for k, v in rb.meta.get("rollout_stats", {}).items()})
        out = {k: float(v) for k, v in out.items()}
        self.last_metrics = out
        # written to the logger now, synchronously, with step = iteration: a checkpoint taken at the end of
        # this iteration can then never be ahead of the metrics on record (a kill right after it loses none)
        if self._trainer is not None and self.trainer.is_global_zero and self.trainer.logger is not None:
            self.trainer.logger.log_metrics(out, step=self.iterations_done - 1)


    def _check_signal(self, rb: RolloutBatch, rewards: Tensor, frac_zero_std: float, reward: float,
                      credit_metrics: dict[str, float]) -> None:
        """Warn when this iteration had no learning signal: every group (on every rank) scored all its samples the
        same, so every GRPO advantage is 0 and the update is (up to KL / entropy terms) nothing. After
        ``trainer.no_signal_patience`` such iterations in a row, and again after as many more, a louder message
        says that the run is training on nothing and what to check. Counted in ``train/no_signal_iterations_total``."""
        has_groups = bool(rb.group_ids.numel()) and self.cfg.rollout.group_size > 1
        with_spread = self._global_sum(float(has_groups and frac_zero_std < 1.0))  # collective: every rank calls it
        if float(with_spread) > 0 or not has_groups:
            self.no_signal_streak = 0
            return
        self.no_signal_streak += 1
        self.totals["no_signal_iterations"] += 1
        if self._trainer is not None and not self.trainer.is_global_zero:
            return
        # a method with its own non-outcome credit (e.g. a teacher's log-ratio) still moves the policy
        other = " (the credit method's own non-outcome credit still moved the policy)" \
            if credit_metrics.get("adv_abs_mean", 0.0) > 0 else ""
        it, total = self.iterations_done, self.cfg.trainer.max_steps
        log.warning("iteration %d/%d: no learning signal: every group's %d samples got equal rewards (mean reward "
                    "%.3f), so every GRPO advantage is 0%s", it, total, self.cfg.rollout.group_size, reward, other)
        patience = self.cfg.trainer.no_signal_patience
        if patience > 0 and self.no_signal_streak % patience == 0:
            if reward <= 0.0:
                why = "no sample earned any reward: check that the answers are extracted and scored as intended " \
                      "(the task's answer format, its reward) and that the problems are within the model's reach"
            elif float(rewards.min()) >= 1.0:
                why = "every sample earned full reward: the problems are too easy for this model"
            else:
                why = "each problem is either always or never solved: use problems of mixed difficulty or a " \
                      "larger rollout.group_size"
            what = ("the rewards teach the policy nothing (only the credit method's own non-outcome credit moves it)"
                    if other else "the run is training on nothing")
            log.error("NO LEARNING SIGNAL for %d iterations in a row (%d of %d so far): %s — %s "
                      "(trainer.no_signal_patience=%d)", self.no_signal_streak, self.totals["no_signal_iterations"], it,
                      what, why, patience)


#: the update's logged terms that are shares of one global loss value (summed, not averaged, over micro-batches)
_LOSS_TERMS = frozenset({"pg_loss", "kl", "entropy_bonus"})


def _grads_finite(model: nn.Module) -> bool:
    """Whether every local gradient (shard) is finite; the caller all-reduces the verdict."""
    flags = [torch.isfinite(g.to_local() if hasattr(g, "to_local") else g).all()
             for g in (p.grad for p in model.parameters()) if g is not None]
    return bool(torch.stack(flags).all()) if flags else True


def _to_container(cfg: Config) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
