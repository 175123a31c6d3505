"""KTAE: key-token advantage estimation from which tokens occur in a group's correct and incorrect responses.

Method: Sun et al., "KTAE: A Model-Free Algorithm to Key-Tokens Advantage Estimation in Mathematical Reasoning"
(arXiv 2505.16826, NeurIPS 2025); code ``xiaolizh1/KTAE@ea9fb77`` (``verl/workers/actor/compute_key_tokens.py``,
``compute_ktae_outcome_advantage_and_keytokens`` in ``verl/trainer/ppo/core_algos.py``). docs/credit/ktae.md.

No model pass. Per group, responses with reward > 0 are "correct", the others "incorrect" [SRC]; for every token id
v of the group (the vocabulary entry, wherever it occurs):

    table   a = #correct responses containing v, b = #incorrect containing v, c = #correct − a, d = #incorrect − b
    F(v)    = exp(−2 p) with p Fisher's exact two-sided p-value of the table, 0 where p = 1            [SRC]
    IG(v)   = H(Y) − H(Y | v occurs), Y = correct, in bits                                          [SRC]
    x(v)    = asin √(a/(a+c)) − asin √(b/(b+d))   (Cohen's h)                                       [SRC]
              + tf_c/(tf_w + 1e-5) − tf_w/(tf_c + 1e-5)   (with ``tf``: BM25-saturated frequencies of v among all
              correct / incorrect tokens, k1 = 2, b = 0.5, lengths against their mean)                  [SRC]
    k(v)    = 2·top·(σ((α F + β IG) x / (α + β)) − 1/2)                                                [SRC]
    A_{i,t} = A_i + k(token_{i,t}) on generated tokens; k = 0 for the ``zero_ids`` tokens              [SRC]

A_i is gearlab's group-normalised outcome advantage (the source's (r − mean)/(std + ε) with Bessel std: the same
with ``algorithm.std_scope=group``). A group whose responses are all correct or all incorrect, or has one response,
gets k ≡ 0 [SRC].

Provenance of choices:
  * α = β = 1, tf on, top = 1: the values ``compute_ktae_outcome_advantage_and_keytokens`` hard-codes [SRC]. The
    released scripts set ``beta_ig=2.0``, which that function never reads: gearlab follows the code.
  * ``zero_ids`` = (151643,): the source zeroes Qwen's ``<|endoftext|>`` [SRC]; other tokenizers: pass their ids.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from gearlab.core.batch import RolloutBatch
from gearlab.credit import CreditAssigner, CreditOutput, Signal, register
from gearlab.credit.options import option


@dataclass
class KTAEOptions:
    alpha: float = option(1.0, "weight of the Fisher-test score F [SRC: hard-coded 1.0]", lo=0.0)
    beta_ig: float = option(1.0, "weight of the information gain IG [SRC: hard-coded 1.0; scripts say 2.0, unread]",
                            lo=0.0)
    tf: bool = option(True, "add the term-frequency contrast to Cohen's h [SRC: gamma_tf=1.0, used as on/off]")
    top: float = option(1.0, "largest key-token weight |k| [SRC]", lo=0.0, lo_open=True)
    zero_ids: list = option([151643], "token ids whose weight is 0 [SRC: Qwen's <|endoftext|>]")


def _log_comb(n: Tensor, k: Tensor) -> Tensor:
    return torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)


def fisher_p(table: Tensor) -> Tensor:
    """Two-sided Fisher exact p-values of 2×2 tables [V, 4] = (a, b, c, d): the summed probability of the tables with
    the same margins that are at most as likely as the observed one (compared exactly in the table's dtype, as the
    source does in float32)."""
    a, b, c, d = table.unbind(1)
    r1, c1, n = a + b, a + c, a + b + c + d
    ks = torch.arange(int(torch.minimum(r1, c1).max()) + 1, dtype=table.dtype)[None]  # [1, K]
    ok = (ks >= (r1 + c1 - n).clamp(min=0)[:, None]) & (ks <= torch.minimum(r1, c1)[:, None])
    kk = torch.where(ok, ks, torch.zeros_like(ks))  # (masked entries are dropped; keep lgamma finite)
    pk = torch.exp(_log_comb(c1[:, None], kk) + _log_comb((n - c1)[:, None], r1[:, None] - kk)
                   - _log_comb(n[:, None], r1[:, None])) * ok
    p_obs = torch.exp(_log_comb(c1, a) + _log_comb(n - c1, r1 - a) - _log_comb(n, r1))
    return torch.where(ok & (pk <= p_obs[:, None]), pk, torch.zeros_like(pk)).sum(1)


def info_gain(table: Tensor) -> Tensor:
    """H(Y) − H(Y | X) in bits for tables [V, 4] (a, b, c, d): Y = correct, X = the token occurs; 0 for empty rows."""
    a, b, c, d = table.unbind(1)
    n = a + b + c + d
    h = lambda p: torch.where(p > 0, -p * torch.log2(p.clamp(min=1e-30)), torch.zeros_like(p))  # noqa: E731

    def h2(x: Tensor, y: Tensor) -> Tensor:
        t = x + y
        return torch.where(t > 0, h(x / t.clamp(min=1e-30)) + h(y / t.clamp(min=1e-30)), torch.zeros_like(t))

    nn = n.clamp(min=1e-30)
    ig = h2(a + c, b + d) - ((a + b) / nn * h2(a, b) + (c + d) / nn * h2(c, d))
    return torch.where(n > 0, ig, torch.zeros_like(ig))


def key_weights(ids: Tensor, mask: Tensor, correct: Tensor, o: KTAEOptions) -> tuple[Tensor, Tensor]:
    """The group's token ids [V] (sorted) and their weights k(v) [V] float32 for one group: ``ids`` / ``mask``
    [G, T] (generated tokens), ``correct`` [G] bool. Empty when the group is all correct or all incorrect."""
    nc, nw = int(correct.sum()), int((~correct).sum())
    if nc == 0 or nw == 0:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0)
    vocab, inv = torch.unique(ids[mask], return_inverse=True)  # inv: each generated token's index in vocab
    V, rows = len(vocab), mask.nonzero()[:, 0]
    occurs = torch.zeros(ids.shape[0], V, dtype=torch.bool)
    occurs[rows, inv] = True
    freq = torch.zeros(2, V, dtype=torch.float32)  # token counts among correct / incorrect tokens
    freq.index_put_(((~correct[rows]).long(), inv), torch.ones(len(inv)), accumulate=True)
    a = occurs[correct].sum(0).float()  # float32 throughout, as the source: its Fisher test compares probabilities
    b = occurs[~correct].sum(0).float()  # exactly, so the dtype decides ties
    table = torch.stack([a, b, nc - a, nw - b], 1)
    ig = info_gain(table) if o.beta_ig else torch.zeros(V)
    f = torch.zeros(V)
    if o.alpha:
        p = fisher_p(table)
        f = torch.where(p != 1.0, torch.exp(-2 * p), f)
    x = torch.asin(torch.sqrt(a / (a + table[:, 2] + 1e-10))) - torch.asin(torch.sqrt(b / (b + table[:, 3] + 1e-10)))
    if o.tf:
        k1, bb = 2.0, 0.5
        totals = freq.sum(1)  # all correct / incorrect tokens
        mean_len = totals.sum() / 2
        rel = freq / totals[:, None]
        sat = rel * (k1 + 1) / (rel + k1 * (1 - bb + bb * totals[:, None] / mean_len))
        x = x + sat[0] / (sat[1] + 1e-5) - sat[1] / (sat[0] + 1e-5)
    k = (o.alpha * f + o.beta_ig * ig) * x / (o.alpha + o.beta_ig)
    k = (torch.sigmoid(k) - 0.5) * 2 * o.top
    if o.zero_ids:
        k = k.masked_fill(torch.isin(vocab, torch.tensor(list(o.zero_ids), dtype=vocab.dtype)), 0.0)
    return vocab, k


@register("ktae")
class KTAEAssigner(CreditAssigner):
    needs = frozenset()  # no model pass: token statistics of the group
    preserves_sign = False  # k(v) can outweigh A_i
    preserves_mass = False
    keeps_zero_groups = True  # an all-equal group has A_i = 0 and k ≡ 0

    Options = KTAEOptions

    def chunk_local(self, rows: int) -> bool:
        return False  # a token's weight depends on every response of its group

    def assign(self, batch: RolloutBatch, seq_advantages: Tensor, signals: dict[Signal, Tensor]) -> CreditOutput:
        mask = batch.response_mask.bool()
        ids, m = batch.response_ids.detach().cpu(), mask.cpu()
        correct = batch.rewards.detach().cpu() > 0
        key = torch.zeros(ids.shape, dtype=torch.float32)
        groups = batch.group_ids.detach().cpu()
        for g in torch.unique(groups).tolist():
            rows = (groups == g).nonzero().flatten()
            if len(rows) < 2:
                continue
            vocab, k = key_weights(ids[rows], m[rows], correct[rows], self)
            if len(vocab):  # every generated token's id is in vocab; padding positions are masked out
                at = torch.searchsorted(vocab, ids[rows]).clamp(max=len(vocab) - 1)
                key[rows] = k[at] * m[rows]
        key = key.to(mask.device)
        adv = (seq_advantages[:, None].to(mask.device).float() + key) * mask.float()
        n = int(mask.sum())
        metrics = {"ktae/key_abs_mean": float(key[mask].abs().mean()) if n else 0.0,
                   "ktae/key_pos_frac": float((key[mask] > 0).float().mean()) if n else 0.0}
        if not math.isfinite(metrics["ktae/key_abs_mean"]):
            raise ValueError("ktae: non-finite key-token weights")
        return CreditOutput(token_advantages=adv, metrics=metrics)
