"""SignalProvider: computes, without gradient, exactly the per-token signals an assigner declared.

The student pass (policy on prompt ⊕ response) gives old log-probs and, if asked, entropy; the
teacher pass (the SAME weights on the privileged prompt ⊕ the same response token ids, never
re-tokenised; docs/credit/README.md#the-teacher) gives teacher log-probs and, with the student's hidden states,
the full-vocabulary KL. Nobody asked → no teacher forward.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gearlab.core.batch import RolloutBatch
from gearlab.core.sdpa import reproducible_attention
from gearlab.core.logprobs import response_hidden, token_kl, token_logprobs
from gearlab.parallel.distributed import gathered_for_signals
from gearlab.signals.registry import (PASS_SIGNALS, TEACHER_SIGNALS, Signal, SignalContext, get_signal, signal_name,
                                      signals_on_gathered_weights)


@dataclass
class PolicyPass:
    """Outputs of one no-grad policy pass over a rollout batch (all [B, T] float32)."""

    logprobs: Tensor
    entropy: Tensor | None


class SignalProvider:
    """Computes signals for a batch in micro-batches of ``micro_batch_size`` sequences.

    ``teacher`` is the model scoring the privileged prompt; None = the policy itself (live teacher).
    """

    def __init__(self, model: nn.Module, *, temperature: float, chunk_size: int = 256, micro_batch_size: int = 16,
                 tokenizer: Any = None, packed: bool = False, compiled: bool = False, crop: bool | None = None) -> None:
        self.model = model
        self.crop = crop  # micro-batches at their own widths (RolloutBatch.cropped); None: on with CUDA
        self.compiled = compiled  # the log-prob / KL head chunks through torch.compile (trainer.compile)
        self.packed = packed  # padding-free forwards (gearlab.core.logprobs.response_hidden)
        self.temperature = temperature
        self.chunk_size = chunk_size
        self.micro_batch_size = micro_batch_size
        self.tokenizer = tokenizer

    def _hidden(self, model: nn.Module, b: RolloutBatch, teacher: bool) -> Tensor:
        if not teacher:
            return response_hidden(model, b.input_ids(), b.full_attention_mask(), b.prompt_ids.shape[1], b.response_len,
                                   packed=self.packed)
        if b.teacher_prompt_ids is None:
            raise ValueError(
                "a teacher signal was requested but the batch has no teacher_prompt_ids (privileged prompt)"
            )
        ids = torch.cat([b.teacher_prompt_ids, b.response_ids], dim=1)
        mask = torch.cat([b.teacher_prompt_mask.bool(), b.attention_mask], dim=1).long()
        return response_hidden(model, ids, mask, b.teacher_prompt_ids.shape[1], b.response_len, packed=self.packed)

    def _micro(self, batch: RolloutBatch):
        for s in range(0, batch.batch_size, self.micro_batch_size):
            yield batch.select(torch.arange(s, min(s + self.micro_batch_size, batch.batch_size)))

    def compute(self, batch: RolloutBatch, needs: frozenset[Signal] | set[Signal], *, with_logprobs: bool = True,
                teacher: nn.Module | None = None, options: dict[str, Any] | None = None,
                resampler: Any = None, rows: Tensor | None = None) -> tuple[PolicyPass | None, dict[Signal, Tensor]]:
        """Returns (student log-probs/entropy or None, {signal: [B, T] float32}) for exactly ``needs``.

        Student and teacher passes run without gradient, micro-batched; values at masked positions are 0.
        ``resampler``: for the Monte-Carlo signals (``gearlab.signals.mc``), what continues the batch's responses.
        ``rows`` [B] bool: the rows whose model-based signals are wanted (None = all); those of the other rows are
        0, and a signal that reads ``SignalContext.rows`` does not compute them. The pass signals cover every row.
        """
        # without cuDNN's attention, whose forward is not promised to repeat bit for bit on Hopper (gearlab.core.sdpa):
        # a signal that differs in its last bit moves the credit and so the update, and the run no longer repeats
        with reproducible_attention():
            return self._compute(batch, frozenset(needs), with_logprobs, teacher, options, resampler, rows)

    def _compute(self, batch: RolloutBatch, needs: frozenset[Signal], with_logprobs: bool, teacher: nn.Module | None,
                 options: dict[str, Any] | None, resampler: Any,
                 rows: Tensor | None) -> tuple[PolicyPass | None, dict[Signal, Tensor]]:
        extra = [s for s in needs if signal_name(s) not in PASS_SIGNALS]
        with_logprobs = with_logprobs or Signal.LOGPROBS in needs
        signals = self._passes(batch, needs, with_logprobs, teacher)
        ppass = None
        if with_logprobs:
            ppass = PolicyPass(signals.pop("_logprobs"), signals.get(Signal.ENTROPY))
            if Signal.LOGPROBS in needs:
                signals[Signal.LOGPROBS] = ppass.logprobs
        if extra:
            try:
                fns = {s: get_signal(s).fn for s in extra}
            except KeyError as e:
                raise ValueError(str(e).strip('"')) from None
            ctx = SignalContext(self.model, self.tokenizer, batch, self.temperature, self.chunk_size,
                                self.micro_batch_size, dict(options or {}), resampler,
                                None if rows is None else rows.bool().cpu())
            m = batch.response_mask.float()
            if rows is not None:
                m = m * rows.to(m.device).float()[:, None]
            was_training = self.model.training
            self.model.eval()
            # sharded: the weights gathered once for all the signals that run forwards, since ranks run different
            # numbers of passes; a resampling signal's continuations gather for generation themselves
            # (gearlab.rollout.mc), so it runs outside that block
            gathered = set(signals_on_gathered_weights(extra))
            ordered = sorted(extra, key=signal_name)
            inside = [s for s in ordered if signal_name(s) in gathered]
            outside = [s for s in ordered if signal_name(s) not in gathered]
            # without autograd, so that a forward kept for its outputs does not keep every layer's activations with
            # them (SHEAR's hidden-state forwards held ~8 GiB per 4K-token row of a 0.6B model); a signal that
            # backpropagates turns it on for its own pass (torch.enable_grad)
            try:
                with gathered_for_signals(self.model) if inside else contextlib.nullcontext(), torch.no_grad():
                    for sig in inside:
                        signals[sig] = fns[sig](ctx).detach().float() * m
                with torch.no_grad():
                    for sig in outside:
                        signals[sig] = fns[sig](ctx).detach().float() * m
            finally:
                self.model.train(was_training)
        return ppass, signals

    @torch.no_grad()
    def _passes(
        self, batch: RolloutBatch, needs: frozenset[Signal], with_logprobs: bool, teacher: nn.Module | None
    ) -> dict:
        want_entropy = Signal.ENTROPY in needs
        want_teacher = any(signal_name(s) in TEACHER_SIGNALS for s in needs)
        if not (with_logprobs or want_entropy or want_teacher):
            return {}
        tmodel = self.model if teacher is None else teacher
        models = {id(self.model): self.model, id(tmodel): tmodel}
        modes = {k: m.training for k, m in models.items()}
        for m in models.values():
            m.eval()
        head, thead = self.model.get_output_embeddings(), tmodel.get_output_embeddings()
        out: dict[Any, list[Tensor]] = {}
        kw = dict(temperature=self.temperature, chunk_size=self.chunk_size, compiled=self.compiled)
        try:
            crop = self.crop if self.crop is not None else batch.response_ids.is_cuda
            for mb in self._micro(batch):
                mb = mb.cropped() if crop else mb  # its own widths; the outputs are padded back to T below
                hs = self._hidden(self.model, mb, teacher=False)
                lp, ent = token_logprobs(hs, head, mb.response_ids, with_entropy=want_entropy, **kw)
                out.setdefault("_logprobs", []).append(lp)
                if want_entropy:
                    out.setdefault(Signal.ENTROPY, []).append(ent)
                if not want_teacher:
                    continue
                ht = self._hidden(tmodel, mb, teacher=True)
                if needs & {Signal.TEACHER_LOGPROBS, Signal.TEACHER_ENTROPY}:
                    tlp, tent = token_logprobs(
                        ht, thead, mb.response_ids, with_entropy=Signal.TEACHER_ENTROPY in needs, **kw
                    )
                    out.setdefault(Signal.TEACHER_LOGPROBS, []).append(tlp)
                    if tent is not None:
                        out.setdefault(Signal.TEACHER_ENTROPY, []).append(tent)
                if Signal.TEACHER_KL in needs:
                    out.setdefault(Signal.TEACHER_KL, []).append(token_kl(hs, ht, head, teacher_head=thead, **kw))
        finally:
            for k, m in models.items():
                m.train(modes[k])
        m = batch.response_mask.float()
        T = batch.response_len
        res = {k: torch.cat([F.pad(x, (0, T - x.shape[1])) for x in v]) * m for k, v in out.items()}
        if Signal.TEACHER_LOGPROBS not in needs:
            res.pop(Signal.TEACHER_LOGPROBS, None)
        return res

