"""The GRPO recipe as a LightningModule (manual optimisation).

One ``training_step`` = one RL iteration:
rollout → rewards → group advantages → signals the assigner declared → token advantages →
``ppo_epochs × mini_batches`` optimizer steps, each accumulated over micro-batches with the loss
normalised by the GLOBAL token/sequence count of the optimizer step (all micro-batches, all ranks; the update is
``gearlab.trainer.update``).
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
from gearlab.parallel.distributed import all_reduce_sum, gather_rows, gathered_for_generation, global_max_int
from gearlab.core.metrics import pass_at_k
from gearlab.core.sdpa import differentiable_attention
from gearlab.rollout.base import SamplingParams, step_seed
from gearlab.rollout.factory import engine_from_config
from gearlab.signals.provider import SignalProvider
from gearlab.trainer.schedule import lr_factor
from gearlab.trainer.teacher import Teacher, needs_teacher
from gearlab.trainer.update import PolicyUpdate
from gearlab.tasks.base import Task


log = logging.getLogger("gearlab")


class GRPOModule(PolicyUpdate, L.LightningModule):
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


def _to_container(cfg: Config) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
