"""GEAR — Granularity-adaptivE Advantage Reweighting (arXiv 2605.11853): a PROPOSED reconstruction.

Provenance (docs/credit/gear.md#provenance). The full text of the paper was NOT available, so only the outline is \
sourced:

* [SRC, abstract] the trajectory-level GRPO advantage is reshaped with token- and segment-level signals
  from self-distillation: an on-policy student is compared with a ground-truth-conditioned teacher; the
  divergence marks adaptive segment boundaries and modulates local advantage weights; where the student
  stays aligned, token-level resolution is kept; where it departs, the continuation is grouped into a
  segment whose advantage is modulated by the divergence at the departure point.
* [3P, figure-caption fragment] the divergence is a token-wise reverse KL KL(π_S ‖ π_T); KL peaks give
  segment onsets and entropy gives their extent. [3P] the teacher context is the ground-truth answer.
* [PROPOSED, docs/credit/gear.md#the-reconstruction] everything concrete below: the onset rule (per-trajectory
  q_on-quantile, absolute floor d_min, local maximum; or a z-score), the extent rule (extend through
  tokens under the q_H entropy quantile, stop at the next onset / fork / masked token / turn boundary /
  L_max), the modulation (below), the per-trajectory mass normalisation w ← w·N/Σw, the answer-leak guard
  on by default, and every default value. The live teacher (same weights, detached) is PROPOSED too.

The modulation (``modulation="tanh"``, the default; docs/credit/gear.md#modulation) [PROPOSED]:
  e_t = max(0, d_t − d_min)                       the divergence above the absolute floor (nats)
  c   = median of e over the group's onsets       a robust scale per group of G responses (``scale``)
  s_t = log1p(e_t / c)                            0 at or below the floor, log 2 at a typical onset
  w_t = 1 − sign(A)·ε_w·tanh(β·s_t)               bounded, smooth, monotone in the departure's size
s is held at its onset value inside a segment, so a segment's weight follows the size of its departure; outside
segments each token keeps its own s_t (0 for sub-floor noise and for answer-guard tokens, whose divergence is
the teacher's knowledge of the answer, not evidence); a response with no onset keeps w ≡ 1. The first
reconstruction (``modulation="exp"``, the variant ``gear_v1``) used g = d / mean(d) and
w = clip(exp(−sign(A)·β·(g−1)), 1−ε_w, 1+ε_w); with onsets at the 0.9 quantile g sits far above 1 there,
so the clip bound for nearly every segment and sub-floor noise moved every weight.

Every open question (docs/credit/gear.md#open-questions-and-their-options) is an option whose default is the PROPOSED \
choice:

  Q1 divergence ........ ``divergence`` = "full_kl" (TEACHER_KL) | "sampled" (log π_S(y_t) − log π_T(y_t)
                         of the sampled token; ``clamp_sampled`` = True clamps it at 0)
  Q2 peak definition ... ``onset_rule`` = "quantile" (``q_on``) | "zscore" (``z_k``); ``d_min`` floor and
                         ``onset_local_max`` apply to both
  Q3 entropy rule ...... ``entropy_rule`` = "low_continues" (reading (a)) | "high_continues" (reading (b));
                         ``entropy_source`` = "student" | "teacher"; ``q_h``; ``l_max``
  Q4 modulation/sign ... ``modulation`` = "tanh" (sign-aware) | "tanh_unsigned" | "exp" | "exp_unsigned"
                         (the first reconstruction) | "none"; ``beta``; ``eps_w``; ``scale`` = "group" |
                         "batch" | "absolute" (``d_scale``)
  Q5 normalisation ..... ``normalisation`` = "sequence" | "group" | "batch" | "none"
  Q6 teacher weights ... ``teacher_mode`` = "live" | "frozen" | "ema"; ``teacher_sync_every``; ``teacher_ema``
  Q7 teacher context ... ``teacher_context`` = "answer" | "solution"
  answer leakage (docs/credit/gear.md#caveats) .. ``exclude_answer_span`` (default on: uses the core's
                         REASONING_MASK signal; the final-answer span is not an onset candidate) and
                         ``exclude_last_tokens`` (tokenizer-free: the last k generated tokens are not candidates)

Resolved details (all [PROPOSED], not in any source):
* Quantiles are per trajectory over its generated tokens, linear interpolation (numpy/torch default),
  computed with a sort, never ``torch.quantile``. The z-score uses the population std.
* Onset candidates ("the pool") are the generated tokens of a sequence with A_i ≠ 0 that are not
  excluded by the answer-span options. The onset quantile / z-score statistics are over the pool; a
  local maximum compares with the neighbours in the pool that are adjacent and in the same turn (a
  missing neighbour counts as −∞). Excluded tokens still join segments and get per-token weights.
* The entropy threshold is the q_h quantile over all generated tokens of the trajectory. Reading (a)
  continues while H < τ_H (a fork H ≥ τ_H ends the segment, the forking-token notion of docs/credit/entropy_fork.md); \
reading (b) continues
  while H ≥ τ_H, with the same threshold.
* Segment length (onset included) is at most l_max. Segments never contain a masked token and never
  cross a change of ``batch.turn_ids``.
* tanh: the group's scale c is the median (linear interpolation) of e over the onsets GEAR finds in the
  group's A ≠ 0 responses; "batch" pools every onset of the global batch (of all data-parallel ranks);
  "absolute" uses c = ``d_scale``. A group without onsets, or with c ≤ 1e-12, has s ≡ 0, so w ≡ 1.
  ``credit/gear_clip_frac`` is the share of segments whose weight factor lies within 1% of ε_w of a bound
  (|w − 1| ≥ 0.99·ε_w, before normalisation).
* exp (the first reconstruction, kept bit-identical): g_t = d_t / mean over the generated tokens of d; if that
  mean is ≤ 1e-12 (e.g. teacher ≡ student, or an unclamped sampled divergence with a non-positive mean) g ≡ 1,
  so w ≡ 1 for that trajectory. No w ≡ 1 rule for responses without onsets, no floor outside segments.
* "group" / "batch" normalisation rescale the weights by one positive factor per group / batch so that
  Σw = ΣN over the tokens of the A ≠ 0 sequences; the sign is kept but Σ_t A_{i,t} = N_i A_i is then
  not exact per trajectory, so ``preserves_mass`` is False for them (and for "none").
* Sequences with A_i = 0 get 0 advantage, no segments and weight 1 on their generated tokens.

Controls (docs/credit/controls.md), ``segmentation`` ≠ "adaptive" — not part of the reconstruction, ablations of it:
* GEAR's segments are found as above; then, per trajectory, the same number of segments, each carrying
  its GEAR segment weight (the strength at the real onset), is put elsewhere: ``random`` keeps each segment's length
  and draws its onset (longest segment first, uniformly among the free positions where it fits whole; if
  none, among all free generated tokens, truncated at the gap's end), ``fixed`` puts onset j at generated
  token floor(j·N/k) with length ``fixed_len`` (0 = the row's mean GEAR length, rounded half up, ≥ 1),
  truncated at a masked token, a turn change or the next onset. Weights go in GEAR's order.
* Tokens outside the control's segments keep their per-token strength; modulation and normalisation as above.
* ``random`` draws from a torch.Generator seeded per row by blake2b(control_seed, the row's real prompt
  ids, its real response ids): the same response (to the same prompt) gets the same placement wherever it
  sits in a batch, and a batch's other rows do not change it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gearlab.core.batch import RolloutBatch
from gearlab.core.reduce import bin_sum
from gearlab.credit import CreditAssigner, CreditOutput, Signal, all_reduce_sum, gather_values, register
from gearlab.credit.controls import place_fixed, place_random
from gearlab.credit.options import option
from gearlab.credit.seeding import row_seeds

DIVERGENCES = ("full_kl", "sampled")
ONSET_RULES = ("quantile", "zscore")
ENTROPY_RULES = ("low_continues", "high_continues")
ENTROPY_SOURCES = ("student", "teacher")
MODULATIONS = ("tanh", "tanh_unsigned", "exp", "exp_unsigned", "none")
SCALES = ("group", "batch", "absolute")
NORMALISATIONS = ("sequence", "group", "batch", "none")
TEACHER_MODES = ("live", "frozen", "ema")
TEACHER_CONTEXTS = ("answer", "solution")
SEGMENTATIONS = ("adaptive", "random", "fixed")

_MEAN_EPS = 1e-12  # below this mean divergence (exp) or scale (tanh), no modulation
_AT_BOUND = 0.99  # a weight factor with |w − 1| ≥ 0.99·ε_w counts as at a bound (credit/gear_clip_frac)
_EXP_ARG_MAX = 50.0  # keeps exp() finite before the clip; any value ≥ log(2) gives the same clipped weight


def _row_quantile(x: Tensor, pool: Tensor, q: float) -> Tensor:
    """[B] q-quantile of x over the True entries of ``pool`` in each row (linear interpolation,
    numpy's default); +inf for an empty row. A sort, so no size limit (unlike torch.quantile)."""
    n = pool.sum(dim=1)
    vals, _ = torch.where(pool, x, torch.full_like(x, math.inf)).sort(dim=1)
    pos = q * (n - 1).clamp(min=0).to(x.dtype)
    lo = pos.floor().long()
    hi = pos.ceil().long()
    v_lo = vals.gather(1, lo[:, None]).squeeze(1)
    v_hi = vals.gather(1, hi[:, None]).squeeze(1)
    out = v_lo + (pos - lo.to(x.dtype)) * (v_hi - v_lo)
    return torch.where(n > 0, out, torch.full_like(out, math.inf))


def _grouped_median(values: Tensor, keys: Tensor, n_keys: int) -> Tensor:
    """[n_keys] median (linear interpolation) of ``values`` [n] per key in 0..n_keys−1; 0 for a key with no value."""
    out = torch.zeros(n_keys, dtype=values.dtype, device=values.device)
    if values.numel() == 0:
        return out
    v, order = values.sort(stable=True)
    k, o2 = keys[order].sort(stable=True)  # grouped by key, ascending values within each key
    v = v[o2]
    counts = torch.bincount(k, minlength=n_keys)
    start = counts.cumsum(0) - counts
    pos = 0.5 * (counts - 1).clamp(min=0).to(values.dtype)
    lo, hi = start + pos.floor().long(), start + pos.ceil().long()
    last = v.numel() - 1
    med = v[lo.clamp(max=last)] + (pos - pos.floor()) * (v[hi.clamp(max=last)] - v[lo.clamp(max=last)])
    return torch.where(counts > 0, med, out)


@dataclass
class GEAROptions:
    """GEAR's options (docs/credit/gear.md#options); every open question of the reconstruction is one."""

    # Q1: the divergence d_t
    divergence: str = option(
        "full_kl", "full-vocabulary KL(π_S‖π_T), or the sampled-token log-ratio", choices=DIVERGENCES
    )
    clamp_sampled: bool = option(True, "divergence=sampled: clamp the single-sample estimate at 0")
    # Q2: onsets
    onset_rule: str = option(
        "quantile", "onsets at the per-trajectory q_on-quantile of d, or at μ + z_k·σ", choices=ONSET_RULES
    )
    q_on: float = option(0.9, "onset quantile of d within a trajectory", lo=0.0, hi=1.0)
    d_min: float = option(0.05, "absolute floor on an onset's divergence (nats)", lo=0.0)
    z_k: float = option(2.0, "onset_rule=zscore: standard deviations above the mean")
    onset_local_max: bool = option(True, "onsets must be local maxima of d")
    exclude_last_tokens: int = option(0, "answer-leak guard: the last k generated tokens cannot be onsets", lo=0)
    exclude_answer_span: bool = option(True, "answer-leak guard: the final-answer span cannot hold onsets")
    # Q3: segment extent
    entropy_rule: str = option(
        "low_continues", "a segment runs while H < Q_{q_h}(H), or while H is high", choices=ENTROPY_RULES
    )
    entropy_source: str = option("student", "whose entropy bounds segments", choices=ENTROPY_SOURCES)
    q_h: float = option(0.8, "entropy quantile that ends a segment", lo=0.0, hi=1.0)
    l_max: int = option(64, "longest segment, onset included (tokens)", lo=1)
    # Q4: segment weights w = 1 − sign(A)·ε_w·tanh(β·log1p(max(0, d − d_min)/c)), c = the group's median onset excess
    modulation: str = option("tanh", "how the onset divergence scales the segment (exp*: the first reconstruction, "
                             "gear_v1)", choices=MODULATIONS)
    beta: float = option(1.0, "modulation strength β", lo=0.0)
    scale: str = option("group", "modulation=tanh: the divergence scale c — the median onset excess of the group or "
                        "batch, or d_scale", choices=SCALES)
    d_scale: float = option(0.5, "scale=absolute: c in nats", lo=0.0, lo_open=True)
    # ε_w < 1 keeps every weight > 0, which is what makes the method sign-preserving
    eps_w: float = option(0.5, "weights are clipped to [1−ε_w, 1+ε_w]", lo=0.0, hi=1.0, hi_open=True)
    # Q5: normalisation
    normalisation: str = option("sequence", "rescale weights to keep each trajectory's (or group's / batch's) mass",
                                choices=NORMALISATIONS)
    # Q6, Q7: the teacher
    teacher_mode: str = option(
        "live", "teacher weights: the current policy, a frozen copy, or an EMA", choices=TEACHER_MODES
    )
    teacher_sync_every: int = option(0, "teacher_mode=frozen: re-sync every k iterations (0 = never)", lo=0)
    teacher_ema: float = option(0.99, "teacher_mode=ema: decay", lo=0.0, hi=1.0)
    teacher_context: str = option("answer", "privileged context the teacher sees", choices=TEACHER_CONTEXTS)
    # controls (docs/credit/controls.md): GEAR's segments, their lengths and weights, at uninformed positions
    segmentation: str = option("adaptive", "segments where GEAR finds them, or its segments moved to random / regular "
                               "positions (a control)", choices=SEGMENTATIONS)
    control_seed: int = option(0, "segmentation=random: seed of the placement, mixed with each row's token ids")
    fixed_len: int = option(0, "segmentation=fixed: segment length (0 = the row's mean GEAR segment length, rounded)",
                            lo=0)


@register("gear")
class GEARAssigner(CreditAssigner):
    """GEAR (arXiv 2605.11853), PROPOSED reconstruction (docs/credit/gear.md#the-reconstruction): divergence-peak \
onsets,
    entropy-bounded segments, sign-aware clipped weights, per-trajectory mass preservation."""

    needs = frozenset({Signal.TEACHER_KL, Signal.ENTROPY})  # with the default options
    preserves_sign = True  # weights are in [1−ε_w, 1+ε_w] with ε_w < 1, then scaled by a positive factor
    preserves_mass = True  # with normalisation="sequence" (the instance attribute follows the option)

    Options = GEAROptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)  # typed options → attributes (gearlab.credit.options)
        self.preserves_mass = self.normalisation == "sequence"
        needs = {Signal.TEACHER_KL} if self.divergence == "full_kl" else {Signal.LOGPROBS, Signal.TEACHER_LOGPROBS}
        # the entropy only sets segment lengths, which segmentation=fixed with a fixed_len > 0 does not use
        self._uses_entropy = not (self.segmentation == "fixed" and self.fixed_len > 0)
        if self._uses_entropy:
            needs.add(Signal.ENTROPY if self.entropy_source == "student" else Signal.TEACHER_ENTROPY)
        if self.exclude_answer_span:
            needs.add(Signal.REASONING_MASK)
        self.needs = frozenset(needs)

        # read by `gearlab inspect` after each assign(): [B, T] tensors of the last batch
        self.last_segments: Tensor | None = None  # long, per-sequence segment index 0.., −1 outside segments
        self.last_weights: Tensor | None = None  # float, final weights (A_{i,t} = w_t·A_i); 0 where masked
        self.last_onsets: Tensor | None = None  # bool, onset tokens
        self.last_divergence: Tensor | None = None  # float, d_t used for onsets and g

    # -- signals ----------------------------------------------------------------------------
    def _signal(self, signals: dict[Signal, Tensor], sig: Signal, like: Tensor) -> Tensor:
        if sig not in signals:
            raise ValueError(
                f"gear: signal {sig.value!r} missing (declared needs: {sorted(s.value for s in self.needs)})"
            )
        x = signals[sig].detach().to(device=like.device, dtype=torch.float64)
        if tuple(x.shape) != tuple(like.shape):
            raise ValueError(f"gear: signal {sig.value!r} has shape {tuple(x.shape)}, expected {tuple(like.shape)}")
        return x

    def _divergence(self, signals: dict[Signal, Tensor], mask: Tensor) -> Tensor:
        if self.divergence == "full_kl":
            d = self._signal(signals, Signal.TEACHER_KL, mask)
        else:  # single-sample (k1) estimate of KL(π_S‖π_T) at the sampled token
            d = self._signal(signals, Signal.LOGPROBS, mask) - self._signal(signals, Signal.TEACHER_LOGPROBS, mask)
            if self.clamp_sampled:
                d = d.clamp(min=0.0)
        return torch.where(mask, d, torch.zeros_like(d))

    # -- the method ---------------------------------------------------------------------------
    def assign(self, batch: RolloutBatch, seq_advantages: Tensor, signals: dict[Signal, Tensor]) -> CreditOutput:
        mask = batch.response_mask
        dev = mask.device
        B, T = mask.shape
        f64 = torch.float64
        A = seq_advantages.detach().to(device=dev, dtype=f64).reshape(B)
        active = (A != 0) & torch.isfinite(A)
        valid = mask & active[:, None]  # generated tokens of the sequences GEAR acts on
        N = valid.sum(dim=1)

        d = self._divergence(signals, mask)
        if self._uses_entropy:
            H = self._signal(
                signals, Signal.ENTROPY if self.entropy_source == "student" else Signal.TEACHER_ENTROPY, mask
            )
        else:  # the lengths of GEAR's own segments are not used (segmentation=fixed, fixed_len > 0)
            H = torch.zeros_like(d)

        # link[t]: t−1 and t are both generated and in the same turn (a segment may step from t−1 to t)
        link = torch.zeros_like(mask)
        same = mask[:, 1:] & mask[:, :-1]
        if batch.turn_ids is not None:
            tid = batch.turn_ids.to(dev)
            same = same & (tid[:, 1:] == tid[:, :-1])
        link[:, 1:] = same

        # 1. onsets ---------------------------------------------------------------------------
        pool, onset = self._onsets(d, valid, mask, link, signals)

        # 2. extent ---------------------------------------------------------------------------
        tau_h = _row_quantile(H, valid, self.q_h)[:, None]
        ent_ok = H < tau_h if self.entropy_rule == "low_continues" else H >= tau_h
        cont = valid & link & ~onset & ent_ok  # t may extend a segment that contains t−1
        idx = torch.arange(T, device=dev).expand(B, T)
        minus1 = torch.full_like(idx, -1)
        last_onset = torch.cummax(torch.where(onset, idx, minus1), dim=1).values
        last_break = torch.cummax(torch.where(~cont & ~onset, idx, minus1), dim=1).values
        in_seg = onset | ((last_onset >= 0) & (last_break < last_onset) & (idx - last_onset < self.l_max))
        seg_ids = torch.where(in_seg, onset.long().cumsum(1) - 1, minus1)

        # 3. strength of each token's departure, held at the onset inside a segment ---------------
        legacy = self.modulation in ("exp", "exp_unsigned")
        g = self._legacy_g(d, valid, N) if legacy else self._strength(d, pool, onset, batch)
        if self.segmentation == "adaptive":
            g = torch.where(in_seg, g.gather(1, last_onset.clamp(min=0)), g)
        else:  # a control: GEAR's segments (count, weights, lengths for random) at other positions
            onset, in_seg, seg_ids, g = self._control(batch, valid, link, onset, seg_ids, g)

        # 4. modulation -------------------------------------------------------------------------
        signed = self.modulation in ("tanh", "exp")
        sgn = (torch.sign(A) if signed else torch.ones_like(A))[:, None]
        if self.modulation == "none":
            w = torch.ones_like(d)
        elif legacy:
            arg = (-sgn * self.beta * (g - 1.0)).clamp(-_EXP_ARG_MAX, _EXP_ARG_MAX)
            w = torch.exp(arg).clamp(1.0 - self.eps_w, 1.0 + self.eps_w)
        else:  # a response that never departs keeps its GRPO advantage on every token
            w = 1.0 - sgn * self.eps_w * torch.tanh(self.beta * g)
            w = torch.where(onset.any(dim=1, keepdim=True), w, torch.ones_like(w))
        w = torch.where(valid, w, torch.zeros_like(w))
        seg_w = w[onset & valid]  # one weight factor per segment, before normalisation
        clip_frac = float(
            ((seg_w - 1.0).abs() >= _AT_BOUND * self.eps_w).double().mean()
        ) if seg_w.numel() and self.eps_w > 0 else 0.0

        # 5. normalisation ------------------------------------------------------------------------
        w = self._normalise(w, N, batch)

        out_dtype = seq_advantages.dtype if seq_advantages.is_floating_point() else torch.float32
        token_adv = (w * A[:, None]).to(out_dtype)

        # bookkeeping for `gearlab inspect`: A = 0 sequences show weight 1 on their generated tokens
        self.last_weights = torch.where(valid, w, mask.to(f64)).float()
        self.last_segments = seg_ids
        self.last_onsets = onset
        self.last_divergence = d.float()
        metrics = {**self._metrics(active, valid, onset, in_seg, w, d), "gear_clip_frac": clip_frac,
                   "onset_strength_mean": float(g[onset & valid].mean()) if bool((onset & valid).any()) else 0.0}
        return CreditOutput(token_advantages=token_adv, metrics=metrics)

    def _onsets(self, d: Tensor, valid: Tensor, mask: Tensor, link: Tensor,
                signals: dict[Signal, Tensor]) -> tuple[Tensor, Tensor]:
        """(pool, onset), both bool [B, T]: the tokens that may start a segment, and those that do (``d`` above the
        row's threshold and ``d_min``; with ``onset_local_max`` also a local maximum within the turn)."""
        f64 = torch.float64
        pool = valid.clone()
        if self.exclude_last_tokens > 0:
            from_end = mask.flip(1).long().cumsum(1).flip(1)  # 1 on the last generated token, 2 before it, …
            pool &= ~(from_end <= self.exclude_last_tokens)
        if self.exclude_answer_span:
            pool &= self._signal(signals, Signal.REASONING_MASK, mask) > 0.5
        if self.onset_rule == "quantile":
            thr = _row_quantile(d, pool, self.q_on)
        else:
            n = pool.sum(dim=1).clamp(min=1).to(f64)
            mu = (d * pool).sum(dim=1) / n
            sigma = (((d - mu[:, None]) ** 2) * pool).sum(dim=1).div(n).sqrt()
            thr = mu + self.z_k * sigma
        onset = pool & (d >= thr[:, None]) & (d >= self.d_min)
        if self.onset_local_max:
            neg = torch.full_like(d, -math.inf)
            nb = link.clone()
            nb[:, 1:] &= pool[:, 1:] & pool[:, :-1]  # nb[t]: t−1 is a usable neighbour of t (and t of t−1)
            prev = neg.clone()
            prev[:, 1:] = torch.where(nb[:, 1:], d[:, :-1], neg[:, 1:])
            nxt = neg.clone()
            nxt[:, :-1] = torch.where(nb[:, 1:], d[:, 1:], neg[:, :-1])
            onset &= (d >= prev) & (d >= nxt)
        return pool, onset

    def _normalise(self, w: Tensor, N: Tensor, batch: RolloutBatch) -> Tensor:
        """``w`` [B, T] rescaled so that each sequence (``sequence``), group or the global batch keeps its GRPO mass:
        the sum of the weights equals its generated-token count ``N``; ``none`` leaves it as it is."""
        dev, B, f64 = w.device, w.shape[0], torch.float64
        if self.normalisation == "sequence":
            w = w * (N.to(f64) / w.sum(dim=1).clamp(min=1e-30))[:, None]
        elif self.normalisation in ("group", "batch"):
            if self.normalisation == "group":
                _, gidx = torch.unique(batch.group_ids.to(dev), return_inverse=True)
            else:
                gidx = torch.zeros(B, dtype=torch.long, device=dev)
            K = int(gidx.max().item()) + 1 if B > 0 else 0
            num = bin_sum(N.to(f64), gidx, K)  # in row order on every device (gearlab.core.reduce)
            den = bin_sum(w.sum(dim=1), gidx, K)
            if self.normalisation == "batch":  # the global batch's mass (a group never spans ranks)
                num, den = all_reduce_sum(num), all_reduce_sum(den)
            w = w * (num / den.clamp(min=1e-30))[gidx][:, None]
        return w

    # -- the strength of a departure ---------------------------------------------------------------
    @staticmethod
    def _legacy_g(d: Tensor, valid: Tensor, N: Tensor) -> Tensor:
        """modulation=exp*: g_t = d_t / (the trajectory's mean d) [B, T]; 1 where that mean is ≤ 1e-12."""
        mean_d = (d * valid).sum(dim=1) / N.clamp(min=1).to(d.dtype)
        ok = (N > 0) & torch.isfinite(mean_d) & (mean_d > _MEAN_EPS)
        return torch.where(
            ok[:, None], d / torch.where(ok, mean_d, torch.ones_like(mean_d))[:, None], torch.ones_like(d)
        )

    def _strength(self, d: Tensor, pool: Tensor, onset: Tensor, batch: RolloutBatch) -> Tensor:
        """modulation=tanh*: s_t = log1p(max(0, d_t − d_min) / c) [B, T] on onset candidates (0 elsewhere), c the
        median excess over the onsets of the row's group (``scale=group``), of the batch, or ``d_scale``."""
        e = torch.where(pool, (d - self.d_min).clamp(min=0.0), torch.zeros_like(d))
        B = d.shape[0]
        if self.scale == "absolute":
            c = torch.full((B,), self.d_scale, dtype=d.dtype, device=d.device)
        else:
            if self.scale == "group":
                _, key = torch.unique(batch.group_ids.to(d.device), return_inverse=True)
            else:
                key = torch.zeros(B, dtype=torch.long, device=d.device)
            rows, cols = onset.nonzero(as_tuple=True)
            if self.scale == "group":
                c = _grouped_median(e[rows, cols], key[rows], int(key.max()) + 1 if B else 0)[key]
            else:  # the median over the onsets of the GLOBAL batch (every rank's, when it is split over ranks)
                pooled = gather_values(e[rows, cols])
                c = _grouped_median(pooled, torch.zeros_like(pooled, dtype=torch.long), 1).expand(B)
        ok = c > _MEAN_EPS
        return torch.where(
            ok[:, None], torch.log1p(e / torch.where(ok, c, torch.ones_like(c))[:, None]), torch.zeros_like(e)
        )

    # -- controls (docs/credit/controls.md) ------------------------------------------------------
    def _control(self, batch: RolloutBatch, valid: Tensor, link: Tensor, onset: Tensor, seg_ids: Tensor,
                 g_tok: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """GEAR's segments of each row re-placed by ``segmentation``: (onset, in_seg, seg_ids, g) of the control,
        g = the segment weight inside a control segment and the per-token g_t elsewhere."""
        dev = g_tok.device
        B, T = g_tok.shape
        v, lk = valid.cpu(), link.cpu()
        nxt_ok = torch.zeros_like(v)
        nxt_ok[:, :-1] = lk[:, 1:] & v[:, 1:]
        prv_ok = lk.clone()
        prv_ok[:, 1:] &= v[:, :-1]
        run_start, run_end = v & ~prv_ok, v & ~nxt_ok  # maximal blocks of generated tokens within one turn
        on_c, seg_c, g_c = onset.cpu(), seg_ids.cpu(), g_tok.cpu()
        seeds = row_seeds(batch, self.control_seed) if self.segmentation == "random" else []
        rows: list[int] = []
        placed_all: list[tuple[int, int, float]] = []
        ids: list[int] = []
        for i in range(B):
            k = int(on_c[i].sum())
            if k == 0:
                continue
            starts = on_c[i].nonzero().flatten().tolist()
            lengths = torch.bincount(seg_c[i][seg_c[i] >= 0], minlength=k).tolist()
            weights = g_c[i, starts].tolist()  # g held at each real onset, in GEAR's order
            runs = list(zip(run_start[i].nonzero().flatten().tolist(), run_end[i].nonzero().flatten().tolist()))
            if self.segmentation == "random":
                gen = torch.Generator().manual_seed(seeds[i])
                placed = place_random(runs, list(zip(lengths, weights)), gen)
            else:
                length = self.fixed_len or max(1, math.floor(sum(lengths) / k + 0.5))
                placed = place_fixed(v[i].nonzero().flatten().tolist(), runs, length, weights)
            rows += [i] * len(placed)
            ids += range(len(placed))
            placed_all += placed
        new_on = torch.zeros(B, T, dtype=torch.bool)
        new_seg = torch.full((B, T), -1, dtype=torch.long)
        held = torch.ones(B, T, dtype=g_tok.dtype)
        if placed_all:  # write every segment at once: row, position, segment id, weight per covered token
            first = torch.tensor([p[0] for p in placed_all])
            n = torch.tensor([p[1] - p[0] + 1 for p in placed_all])
            r = torch.tensor(rows)
            new_on[r, first] = True
            cum = n.cumsum(0)
            cols = first.repeat_interleave(n) + torch.arange(int(cum[-1])) - (cum - n).repeat_interleave(n)
            r_tok = r.repeat_interleave(n)
            new_seg[r_tok, cols] = torch.tensor(ids).repeat_interleave(n)
            held[r_tok, cols] = torch.tensor([p[2] for p in placed_all], dtype=g_tok.dtype).repeat_interleave(n)
        new_on, new_seg = new_on.to(dev), new_seg.to(dev)
        in_seg = new_seg >= 0
        return new_on, in_seg, new_seg, torch.where(in_seg, held.to(dev), g_tok)

    @staticmethod
    def _metrics(
        active: Tensor, valid: Tensor, onset: Tensor, in_seg: Tensor, w: Tensor, d: Tensor
    ) -> dict[str, float]:
        """Means over the A ≠ 0 sequences; an empty set reports 0 (weights are > 0, so 0 means "none")."""
        n_act = int(active.sum())
        n_tok = int(valid.sum())
        n_seg = int(onset.sum())
        n_in = int(in_seg.sum())
        out_seg = valid & ~in_seg
        n_out = int(out_seg.sum())
        return {
            "frac_active_seqs": n_act / max(1, active.numel()),
            "segments_per_seq": n_seg / n_act if n_act else 0.0,
            "segment_len_mean": n_in / n_seg if n_seg else 0.0,
            "frac_tokens_in_segments": n_in / n_tok if n_tok else 0.0,
            "weight_in_seg_mean": float(w[in_seg].sum()) / n_in if n_in else 0.0,
            "weight_out_seg_mean": float(w[out_seg].sum()) / n_out if n_out else 0.0,
            "weight_min": float(w[valid].min()) if n_tok else 0.0,
            "weight_max": float(w[valid].max()) if n_tok else 0.0,
            "divergence_mean": float(d[valid].sum()) / n_tok if n_tok else 0.0,
        }
