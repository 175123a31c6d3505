"""SignalProvider: computes, without gradient, exactly the per-token signals an assigner declared.

The student pass (policy on prompt ⊕ response) gives old log-probs and, if asked, entropy; the
teacher pass (the SAME weights on the privileged prompt ⊕ the same response token ids, never
re-tokenised; methods.md §6.3) gives teacher log-probs and, with the student's hidden states,
the full-vocabulary KL. Nobody asked → no teacher forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gearlab.batch import RolloutBatch
from gearlab.credit import Signal
from gearlab.logprobs import response_hidden, token_kl, token_logprobs


@dataclass
class PolicyPass:
    """Outputs of one no-grad policy pass over a rollout batch (all [B, T] float32)."""

    logprobs: Tensor
    entropy: Tensor | None


class SignalProvider:
    """Computes signals for a batch in micro-batches of ``micro_batch_size`` sequences."""

    def __init__(self, model: nn.Module, *, temperature: float, chunk_size: int = 256, micro_batch_size: int = 16) -> None:
        self.model = model
        self.temperature = temperature
        self.chunk_size = chunk_size
        self.micro_batch_size = micro_batch_size

    def _head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def _student_hidden(self, b: RolloutBatch) -> Tensor:
        return response_hidden(self.model, b.input_ids(), b.full_attention_mask(), b.prompt_ids.shape[1], b.response_len)

    def _teacher_hidden(self, b: RolloutBatch) -> Tensor:
        if b.teacher_prompt_ids is None:
            raise ValueError("a teacher signal was requested but the batch has no teacher_prompt_ids (privileged prompt)")
        ids = torch.cat([b.teacher_prompt_ids, b.response_ids], dim=1)
        mask = torch.cat([b.teacher_prompt_mask.bool(), b.attention_mask], dim=1).long()
        return response_hidden(self.model, ids, mask, b.teacher_prompt_ids.shape[1], b.response_len)

    def _micro(self, batch: RolloutBatch):
        for s in range(0, batch.batch_size, self.micro_batch_size):
            yield batch.select(torch.arange(s, min(s + self.micro_batch_size, batch.batch_size)))

    @torch.no_grad()
    def compute(self, batch: RolloutBatch, needs: frozenset[Signal] | set[Signal], *, with_logprobs: bool = True) -> tuple[PolicyPass | None, dict[Signal, Tensor]]:
        """One pass over the batch. Returns (student log-probs/entropy or None, {signal: [B, T]}).

        Values at masked positions are set to 0 so that no assigner reads garbage there.
        """
        needs = frozenset(needs)
        want_entropy = Signal.ENTROPY in needs
        want_teacher = bool(needs & {Signal.TEACHER_LOGPROBS, Signal.TEACHER_KL})
        if not (with_logprobs or want_entropy or want_teacher):
            return None, {}
        was_training = self.model.training
        self.model.eval()
        head = self._head()
        lps, ents, tlps, kls = [], [], [], []
        try:
            for mb in self._micro(batch):
                hs = self._student_hidden(mb)
                lp, ent = token_logprobs(hs, head, mb.response_ids, temperature=self.temperature,
                                         chunk_size=self.chunk_size, with_entropy=want_entropy)
                lps.append(lp)
                ents.append(ent)
                if want_teacher:
                    ht = self._teacher_hidden(mb)
                    if Signal.TEACHER_LOGPROBS in needs:
                        tlps.append(token_logprobs(ht, head, mb.response_ids, temperature=self.temperature, chunk_size=self.chunk_size)[0])
                    if Signal.TEACHER_KL in needs:
                        kls.append(token_kl(hs, ht, head, temperature=self.temperature, chunk_size=self.chunk_size))
        finally:
            self.model.train(was_training)
        m = batch.response_mask.float()
        signals: dict[Signal, Tensor] = {}
        if want_entropy:
            signals[Signal.ENTROPY] = torch.cat(ents) * m
        if tlps:
            signals[Signal.TEACHER_LOGPROBS] = torch.cat(tlps) * m
        if kls:
            signals[Signal.TEACHER_KL] = torch.cat(kls) * m
        ppass = PolicyPass(torch.cat(lps) * m, signals.get(Signal.ENTROPY)) if with_logprobs else None
        return ppass, signals
