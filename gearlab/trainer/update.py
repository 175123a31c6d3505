"""The policy update of one GRPO iteration: mini-batches of the global batch, micro-batch losses normalised by the
optimizer step's GLOBAL token / sequence counts (all micro-batches, all ranks), a step every rank skips together when
a loss or gradient is non-finite on any of them, and the update's logged values (global, whatever the rank count).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from gearlab.core import grpo
from gearlab.core.batch import RolloutBatch
from gearlab.core.logprobs import response_hidden, token_logprobs
from gearlab.credit import CreditOutput, Signal
from gearlab.parallel.distributed import all_reduce_sum, global_max_int, is_fsdp1
from gearlab.rollout.base import step_seed
from gearlab.trainer.batching import micro_batches, tiled_mini_batches


class NonFiniteLossError(RuntimeError):
    pass



class PolicyUpdate:
    """The update half of ``GRPOModule`` (a mixin: it uses the LightningModule's ``cfg``, ``policy``, ``assigner``,
    ``engine``, optimizers and trainer): ``ppo_epochs × mini_batches`` optimizer steps over one rollout, each
    accumulated over micro-batches whose losses are divided by the global token / sequence counts of the step."""

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



#: the update's logged terms that are shares of one global loss value (summed, not averaged, over micro-batches)
_LOSS_TERMS = frozenset({"pg_loss", "kl", "entropy_bonus"})


def _grads_finite(model: nn.Module) -> bool:
    """Whether every local gradient (shard) is finite; the caller all-reduces the verdict."""
    flags = [torch.isfinite(g.to_local() if hasattr(g, "to_local") else g).all()
             for g in (p.grad for p in model.parameters()) if g is not None]
    return bool(torch.stack(flags).all()) if flags else True
