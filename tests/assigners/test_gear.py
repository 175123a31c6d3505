"""GEAR assigner (docs/credit/gear.md, PROPOSED reconstruction): hand-computed values on a tiny batch.

Two halves. The first pins the segmentation and the first reconstruction's modulation (``V1``: modulation=exp,
no answer-leak guard; the variant ``gear_v1``), with these defaults unless a test says otherwise: full_kl
divergence, q_on = 0.9, d_min = 0.05, local max, low_continues with q_h = 0.8 on the student entropy, l_max = 64,
w = clip(exp(−sign(A)(g−1)), 0.5, 1.5), per-sequence mass normalisation w ← w·N/Σw. The second
(``# === modulation=tanh``) pins the default modulation: w = 1 − sign(A)·ε_w·tanh(β·log1p(max(0, d − d_min)/c)).

Quantiles are linear-interpolation quantiles over the generated tokens of one sequence: with the n
sorted values v_0..v_{n−1}, pos = q·(n−1), Q = v[floor(pos)] + frac(pos)·(v[ceil(pos)] − v[floor(pos)]).
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from gearlab import credit
from gearlab.core.batch import RolloutBatch
from gearlab.credit import Signal

from assigners.gear import GEARAssigner

T = 12
V1 = {"modulation": "exp", "exclude_answer_span": False}  # the first reconstruction (conf/assigner/gear_v1.yaml)


def v1(opts=None):
    """GEAR with the first reconstruction's modulation and no answer-leak guard, plus ``opts``."""
    return credit.build("gear", {**V1, **(opts or {})})


E13 = math.exp(1 / 3)  # 1.395612: g = 2/3 for A > 0 → exp(−(2/3 − 1)), inside [0.5, 1.5]
EM13 = math.exp(-1 / 3)  # 0.716531: g = 2/3 for A < 0 → exp(+(2/3 − 1))
EM23 = math.exp(-2 / 3)  # 0.513417: g = 1/3 for A < 0 → exp(1/3 − 1)
EM06 = math.exp(-0.6)  # 0.548812: g = 0.4 for A < 0 → exp(0.4 − 1)

# ---------------------------------------------------------------------------------- the batch
# seq 0 (A = +1) and seq 1 (A = −1): 10 generated tokens t0..t9, t10..t11 padding, one turn.
D01 = [0.1, 0.1, 1.0, 0.2, 0.1, 0.1, 1.0, 0.1, 0.1, 0.2]
H01 = [0.5, 0.5, 0.2, 0.1, 0.1, 2.0, 0.3, 1.0, 0.1, 0.1]
#   onsets: sorted d = 0.1×6, 0.2×2, 1.0×2; pos = 0.9·9 = 8.1 → Q = 1.0 + 0.1·(1.0−1.0) = 1.0 ≥ d_min.
#           d ≥ 1.0 at t2 (neighbours 0.1, 0.2) and t6 (0.1, 0.1): both local maxima → onsets {2, 6}.
#   entropy: sorted H = 0.1×4, 0.2, 0.3, 0.5, 0.5, 1.0, 2.0; pos = 0.8·9 = 7.2 → τ_H = 0.5 + 0.2·(1.0−0.5) = 0.6.
#           forks (H ≥ 0.6): t5 (2.0), t7 (1.0).
#   (a) low_continues:  from t2: t3 (0.1), t4 (0.1) continue, t5 is a fork → [2, 4];  from t6: t7 fork → [6].
#   (b) high_continues: from t2: t3 (0.1 < 0.6) stops → [2];  from t6: t7 (1.0) continues, t8 (0.1) stops → [6, 7].
#   g = d / mean(d), mean(d) = (6·0.1 + 2·0.2 + 2·1.0)/10 = 0.3: d=0.1 → 1/3, d=0.2 → 2/3, d=1.0 → 10/3.
#   A = +1: g = 1/3 → exp(2/3) = 1.95 → clip 1.5;  g = 2/3 → exp(1/3) = 1.3956;  g = 10/3 → exp(−7/3) = 0.097 → 0.5.
#   A = −1: g = 1/3 → exp(−2/3) = 0.5134;  g = 2/3 → exp(−1/3) = 0.7165;  g = 10/3 → exp(7/3) = 10.3 → 1.5.
SEQ0_A = [1.5, 1.5, 0.5, 0.5, 0.5, 1.5, 0.5, 1.5, 1.5, E13]  # t3, t4 take g(t2) = 10/3 inside [2, 4]
SEQ0_B = [1.5, 1.5, 0.5, E13, 1.5, 1.5, 0.5, 0.5, 1.5, E13]  # t3 (d=.2) and t4 (d=.1) are per-token; t7 takes g(t6)
SEQ1_A = [EM23, EM23, 1.5, 1.5, 1.5, EM23, 1.5, EM23, EM23, EM13]
# seq 2 (A = +0.5): t0..t5 generated; turn 0 = t0..t2, turn 1 = t3.. (a turn change with no masked token).
D2 = [0.1, 1.0, 0.1, 0.1, 0.1, 0.1]
H2 = [0.1, 0.2, 0.1, 0.1, 0.2, 1.0]
#   onsets: sorted d = 0.1×5, 1.0; pos = 0.9·5 = 4.5 → Q = 0.1 + 0.5·0.9 = 0.55 → onset {1}.
#   entropy: sorted H = 0.1×3, 0.2×2, 1.0; pos = 0.8·5 = 4 → τ_H = 0.2; H < 0.2 continues.
#   from t1: t2 (0.1) continues; t3 (0.1 < 0.2) would continue but is in turn 1 → segment [1, 2].
#   (with no turn ids: t3 continues, t4 (0.2) stops → [1, 3].)
#   mean(d) = 1.5/6 = 0.25 → g = 0.4 outside, 4 in the segment; A > 0: exp(0.6) → 1.5, exp(−3) → 0.5.
#   w = [1.5, .5, .5, 1.5, 1.5, 1.5], Σ = 7, N = 6 → w·6/7 = [9/7, 3/7, 3/7, 9/7, 9/7, 9/7].
SEQ2 = [1.5, 0.5, 0.5, 1.5, 1.5, 1.5]
# seq 3 (A = −0.5): t0..t2 generated, t3..t4 tool text (attention 1, response 0), t5..t7 generated, one turn.
D3 = [0.1, 0.1, 1.0, 0.0, 0.0, 0.1, 0.1, 0.1]
H3 = [0.1, 0.2, 0.1, 0.0, 0.0, 0.1, 0.1, 0.2]
#   onsets: generated d = 0.1×5, 1.0 → Q = 0.55 (as seq 2) → t2 (prev 0.1; next is masked = absent) → onset {2}.
#   entropy: generated H = 0.1×4, 0.2×2; pos = 4 → τ_H = 0.2. t3 is masked → segment [2, 2];
#   t5 (H 0.1) does not resume it.
#   mean(d) = 0.25 → g = 0.4 / 4; A < 0: exp(0.4−1) = 0.5488;  exp(4−1) → 1.5.
SEQ3 = [EM06, EM06, 1.5, 0.0, 0.0, EM06, EM06, EM06]
# seq 4: A = 0, the signals of seq 0 → zero advantage, no segments.

ADV = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0])


def _pad(x, fill=0.0):
    return list(x) + [fill] * (T - len(x))


def make_batch(turns: bool = True) -> tuple[RolloutBatch, dict[Signal, torch.Tensor]]:
    resp = [[1] * 10 + [0] * 2, [1] * 10 + [0] * 2, [1] * 6 + [0] * 6, [1, 1, 1, 0, 0, 1, 1, 1] + [0] * 4,
            [1] * 10 + [0] * 2]
    attn = [r[:] for r in resp]
    attn[3] = [1] * 8 + [0] * 4  # the tool tokens are real response tokens, not generated by the policy
    turn_ids = torch.zeros(5, T, dtype=torch.long)
    turn_ids[2, 3:] = 1
    d = torch.tensor([_pad(D01), _pad(D01), _pad(D2), _pad(D3), _pad(D01)], dtype=torch.float32)
    H = torch.tensor([_pad(H01), _pad(H01), _pad(H2), _pad(H3), _pad(H01)], dtype=torch.float32)
    batch = RolloutBatch(prompt_ids=torch.ones(5, 2, dtype=torch.long), prompt_mask=torch.ones(5, 2, dtype=torch.long),
                         response_ids=torch.ones(5, T, dtype=torch.long),
                         response_mask=torch.tensor(resp, dtype=torch.bool), attention_mask=torch.tensor(attn,
                         dtype=torch.bool),
                         group_ids=torch.tensor([0, 0, 1, 1, 2]), rewards=torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0]),
                         turn_ids=turn_ids if turns else None)
    return batch, {Signal.TEACHER_KL: d, Signal.ENTROPY: H}


def normed(w):
    """Per-sequence mass normalisation of hand weights: w·N/Σw over the generated tokens."""
    n = sum(1 for x in w if x != 0.0)
    s = sum(w)
    return [x * n / s for x in w]


def segs(*ranges):
    """Expected segment-id row: ranges (start, end inclusive) numbered 0, 1, …; −1 elsewhere."""
    row = [-1] * T
    for k, (s, e) in enumerate(ranges):
        for t in range(s, e + 1):
            row[t] = k
    return row


def assert_close_to(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected,
                               dtype=torch.float64),
                               atol=atol, rtol=0.0)


def run(signals=None, turns=True, adv=ADV, **opts):
    batch, sig = make_batch(turns)
    a = v1(opts)
    out = a.assign(batch, adv, sig if signals is None else signals)
    return a, out, batch


# ---------------------------------------------------------------------------------- hand values
def test_default_reading_a_hand_values():
    a, out, batch = run()
    assert a.last_segments.tolist() == [
        segs((2, 4), (6, 6)),
        segs((2, 4), (6, 6)),
        segs((1, 2)),  # stops at the turn change t2 → t3
        segs((2, 2)),  # stops at the masked tool token t3
        segs(),  # A = 0: skipped
    ]
    assert_close_to(a.last_weights[0], _pad(normed(SEQ0_A)))  # Σ = 5·1.5 + 4·0.5 + e^{1/3} = 10.8956 → ×10/10.8956
    assert_close_to(a.last_weights[1], _pad(normed(SEQ1_A)))  # Σ = 4·1.5 + 5·e^{−2/3} + e^{−1/3} = 9.2836 → ×10/9.2836
    assert_close_to(a.last_weights[2], _pad([9 / 7, 3 / 7, 3 / 7, 9 / 7, 9 / 7, 9 / 7]))
    assert_close_to(a.last_weights[3], _pad(normed(SEQ3)))  # Σ = 5·e^{−0.6} + 1.5 = 4.2441 → ×6/4.2441
    assert_close_to(a.last_weights[4], _pad([1.0] * 10))  # A = 0: neutral weight, reported for inspection only
    expected = torch.tensor([_pad(normed(SEQ0_A)), [-x for x in _pad(normed(SEQ1_A))],
                             _pad([0.5 * x for x in [9 / 7, 3 / 7, 3 / 7, 9 / 7, 9 / 7, 9 / 7]]),
                             [-0.5 * x for x in _pad(normed(SEQ3))], [0.0] * T])
    assert_close_to(out.token_advantages, expected)
    assert out.token_advantages.dtype == torch.float32
    # diagnostics over the 4 sequences with A ≠ 0: segments 2+2+1+1 = 6, tokens in them 4+4+2+1 = 11 of 10+10+6+6 = 32
    m = out.metrics
    assert_close_to(m["segments_per_seq"], 6 / 4)
    assert_close_to(m["segment_len_mean"], 11 / 6)
    assert_close_to(m["frac_tokens_in_segments"], 11 / 32)
    assert_close_to(m["frac_active_seqs"], 4 / 5)
    w = a.last_weights
    in_seg = a.last_segments >= 0
    valid = batch.response_mask & (ADV != 0)[:, None]
    assert_close_to(m["weight_in_seg_mean"], w[in_seg].double().mean())
    assert_close_to(m["weight_out_seg_mean"], w[valid & ~in_seg].double().mean())


def test_reading_b_high_entropy_continues():
    a, out, _ = run(entropy_rule="high_continues")
    # seq 0/1: [2] and [6, 7] (see the table above); seq 2: t2 (H 0.1 < τ 0.2) stops → [1];
    # seq 3: t3 masked → [2] (as in reading (a))
    assert a.last_segments.tolist()[:4] == [segs((2, 2), (6, 7)), segs((2, 2), (6, 7)), segs((1, 1)), segs((2, 2))]
    # seq 0: Σ = 1.5·5 + 0.5·3 + 2·e^{1/3} = 11.7912 → ×10/11.7912
    assert_close_to(a.last_weights[0], _pad(normed(SEQ0_B)))
    assert_close_to(out.token_advantages[0], _pad(normed(SEQ0_B)))
    # seq 2: w = [1.5, .5, 1.5 (t2 now per-token, g 0.4), 1.5, 1.5, 1.5], Σ = 8 → ×6/8
    assert_close_to(out.token_advantages[2], _pad([0.5 * x * 6 / 8 for x in [1.5, 0.5, 1.5, 1.5, 1.5, 1.5]]))


def test_segments_stop_at_turn_boundary_not_without_it():
    a, _, _ = run(turns=False)
    # same tokens, no turn ids: seq 2's segment now runs on to t3 and stops at t4 (H 0.2 ≥ τ_H 0.2)
    assert a.last_segments[2].tolist() == segs((1, 3))
    a, _, _ = run()
    assert a.last_segments[2].tolist() == segs((1, 2))


def test_segments_never_contain_masked_tokens_or_cross_turns():
    for rule in ("low_continues", "high_continues"):
        for l_max in (1, 2, 64):
            a, _, batch = run(entropy_rule=rule, l_max=l_max, q_h=0.0 if rule == "high_continues" else 1.0)
            seg = a.last_segments
            assert not (seg >= 0)[~batch.response_mask].any()
            same_seg = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] >= 0)
            assert not (same_seg & (batch.turn_ids[:, 1:] != batch.turn_ids[:, :-1])).any()
            assert not (same_seg & ~(batch.response_mask[:, 1:] & batch.response_mask[:, :-1])).any()
            lengths = torch.stack([(seg == k).sum(1) for k in range(T)])
            assert int(lengths.max()) <= l_max


def test_l_max_caps_the_segment():
    a, out, _ = run(l_max=2)
    # seq 0, reading (a): [2, 4] is cut to [2, 3]; t4 becomes per-token (g = 1/3 → 1.5)
    assert a.last_segments[0].tolist() == segs((2, 3), (6, 6))
    w = [1.5, 1.5, 0.5, 0.5, 1.5, 1.5, 0.5, 1.5, 1.5, E13]  # Σ = 11.8956
    assert_close_to(out.token_advantages[0], _pad(normed(w)))


def test_zero_advantage_sequences_stay_zero():
    for opts in ({}, {"normalisation": "group"}, {"normalisation": "none"}, {"modulation": "none"}):
        a, out, _ = run(**opts)
        assert out.token_advantages[4].abs().sum() == 0
        assert (a.last_segments[4] == -1).all()
    # an all-zero batch: no segments, zero advantages, finite metrics
    a, out, _ = run(adv=torch.zeros(5))
    assert out.token_advantages.abs().sum() == 0 and (a.last_segments == -1).all()
    assert all(math.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("opts", [
    {}, {"entropy_rule": "high_continues"}, {"modulation": "exp_unsigned"}, {"modulation": "none"},
    {"normalisation": "group"}, {"normalisation": "batch"}, {"normalisation": "none"}, {"eps_w": 0.99, "beta": 5.0},
    {"onset_rule": "zscore", "z_k": 1.0}, {"exclude_last_tokens": 3},
])
def test_sign_preserved_and_masked_zero(opts):
    _, out, batch = run(**opts)
    adv = out.token_advantages
    assert (adv[~batch.response_mask] == 0).all()
    gen = batch.response_mask & (ADV != 0)[:, None]
    assert (torch.sign(adv)[gen] == torch.sign(ADV)[:, None].expand_as(adv)[gen]).all()


@pytest.mark.parametrize("opts", [{}, {"entropy_rule": "high_continues"}, {"modulation": "exp_unsigned"},
                                  {"eps_w": 0.9, "beta": 3.0}, {"divergence": "sampled"}])
def test_mass_preserved_per_sequence(opts):
    batch, sig = make_batch()
    if opts.get("divergence") == "sampled":
        sig = {Signal.LOGPROBS: -sig[Signal.ENTROPY] * 0.7, Signal.TEACHER_LOGPROBS: -sig[Signal.TEACHER_KL],
               Signal.ENTROPY: sig[Signal.ENTROPY]}
    a = v1(opts)
    assert a.preserves_mass
    out = a.assign(batch, ADV, sig)
    N = batch.response_mask.sum(1).double()
    assert_close_to(out.token_advantages.double().sum(1), N * ADV.double(), atol=1e-5)


def test_normalisation_options():
    a, out, batch = run(normalisation="none")
    assert a.preserves_mass is False and GEARAssigner.preserves_mass is True
    assert_close_to(out.token_advantages[0], _pad(SEQ0_A))  # the raw clipped weights, no rescaling
    assert_close_to(out.token_advantages[2], _pad([0.5 * x for x in SEQ2]))
    a, out, _ = run(normalisation="group")
    assert a.preserves_mass is False
    # group 0 = seq 0, 1: one factor (10 + 10)/(Σw_0 + Σw_1) for both
    s0, s1 = sum(SEQ0_A), sum(SEQ1_A)
    assert_close_to(a.last_weights[0], _pad([x * 20 / (s0 + s1) for x in SEQ0_A]))
    assert_close_to(a.last_weights[1], _pad([x * 20 / (s0 + s1) for x in SEQ1_A]))
    a, _, _ = run(normalisation="batch")
    valid = batch.response_mask & (ADV != 0)[:, None]
    assert_close_to(a.last_weights[valid].double().sum(), 32.0, atol=1e-5)


def test_modulation_options():
    a, out, _ = run(modulation="none")
    assert a.last_segments[0].tolist() == segs((2, 4), (6, 6))  # segments are still found and reported
    assert_close_to(out.token_advantages, ADV[:, None] * make_batch()[0].response_mask.float())  # = GRPO
    a, _, _ = run(modulation="exp_unsigned")
    # A < 0 now gets the A > 0 form: seq 1 weights equal seq 0's
    assert_close_to(a.last_weights[1], a.last_weights[0])
    a, _, _ = run(beta=0.0)
    assert_close_to(a.last_weights[:4], make_batch()[0].response_mask[:4].float())  # exp(0) = 1 everywhere


def test_deterministic_and_row_independent():
    batch, sig = make_batch()
    a = v1()
    o1, o2 = a.assign(batch, ADV, sig), a.assign(batch, ADV, sig)
    assert torch.equal(o1.token_advantages, o2.token_advantages)
    # per-sequence scope: a sub-batch gives the same rows
    idx = torch.tensor([3, 0])
    o3 = a.assign(batch.select(idx), ADV[idx], {k: v[idx] for k, v in sig.items()})
    assert_close_to(o3.token_advantages, o1.token_advantages[idx])


# ---------------------------------------------------------------------------------- other paths
def _one_seq(lp_minus_tlp, H):
    n = len(lp_minus_tlp)
    batch = RolloutBatch(prompt_ids=torch.ones(1, 1, dtype=torch.long), prompt_mask=torch.ones(1, 1, dtype=torch.long),
                         response_ids=torch.ones(1, n, dtype=torch.long), response_mask=torch.ones(1, n,
                         dtype=torch.bool),
                         group_ids=torch.tensor([0]), rewards=torch.tensor([1.0]))
    tlp = torch.full((1, n), -2.0)
    sig = {Signal.LOGPROBS: tlp + torch.tensor([lp_minus_tlp]), Signal.TEACHER_LOGPROBS: tlp,
           Signal.ENTROPY: torch.tensor([H])}
    return batch, sig


def test_sampled_divergence_clamped_and_unclamped():
    a = v1({"divergence": "sampled"})
    assert a.needs == {Signal.LOGPROBS, Signal.TEACHER_LOGPROBS, Signal.ENTROPY}
    batch, sig = _one_seq([-0.4, 1.0, 0.1, 0.1, 0.1, 0.1], [0.1, 0.2, 0.1, 0.1, 0.2, 1.0])
    # clamped d = [0, 1, .1, .1, .1, .1]: sorted 0, .1×4, 1 → Q = .1 + .5·.9 = .55 → onset {1};
    # τ_H = 0.2 (as seq 2) → t2, t3 continue, t4 (0.2) stops → [1, 3].
    # mean d = 1.4/6 → g = 0, 30/7, 30/7, 30/7, 3/7, 3/7 → w = 1.5 (exp 1), .5, .5, .5, 1.5 (exp 4/7), 1.5; Σ = 6 → ×1
    out = a.assign(batch, torch.tensor([1.0]), sig)
    assert a.last_segments[0].tolist() == [-1, 0, 0, 0, -1, -1]
    assert_close_to(out.token_advantages[0], [1.5, 0.5, 0.5, 0.5, 1.5, 1.5])
    # unclamped: d[0] = −0.4, same onset and segment; mean d = 1/6 → g(t4, t5) = 0.6 → exp(0.4) = 1.4918;
    # g(t0) = −2.4 → exp(3.4) → 1.5; Σ = 3 + 2·e^{0.4} = 5.9836 → ×6/5.9836
    a = v1({"divergence": "sampled", "clamp_sampled": False})
    out = a.assign(batch, torch.tensor([1.0]), sig)
    assert a.last_segments[0].tolist() == [-1, 0, 0, 0, -1, -1]
    assert_close_to(out.token_advantages[0], normed([1.5, 0.5, 0.5, 0.5, math.exp(0.4), math.exp(0.4)]))
    # a non-positive mean of the unclamped estimate (Σd = −1) → g ≡ 1, so w ≡ 1 even though t2
    # (0.1 ≥ Q = 0 + .5·.1 = .05 and ≥ d_min, a local max) is an onset
    batch, sig = _one_seq([-0.5, -0.2, 0.1, -0.3, 0.0, -0.1], [0.1, 0.2, 0.1, 0.1, 0.2, 1.0])
    out = a.assign(batch, torch.tensor([-2.0]), sig)
    assert_close_to(out.token_advantages[0], [-2.0] * 6)


def test_sampled_equals_full_kl_when_estimates_agree():
    batch, sig = make_batch()
    sampled = {Signal.TEACHER_LOGPROBS: torch.full((5, T), -3.0) * batch.response_mask,
               Signal.ENTROPY: sig[Signal.ENTROPY]}
    sampled[Signal.LOGPROBS] = sampled[Signal.TEACHER_LOGPROBS] + sig[Signal.TEACHER_KL]
    o_kl = v1().assign(batch, ADV, sig)
    o_s = v1({"divergence": "sampled"}).assign(batch, ADV, sampled)
    assert_close_to(o_s.token_advantages, o_kl.token_advantages)


def test_zscore_onsets():
    # seq 0: μ = 0.3, σ² = (6·0.04 + 2·0.01 + 2·0.49)/10 = 0.124, σ = 0.35214
    #   z_k = 2: thr = 1.00427 > 1.0 → no onset in seq 0 (every token per-token)
    #   z_k = 1: thr = 0.65214 → onsets {2, 6}, the quantile rule's
    a, out, _ = run(onset_rule="zscore")
    assert (a.last_segments[0] == -1).all()
    assert_close_to(out.token_advantages[0], _pad(normed([1.5, 1.5, 0.5, E13, 1.5, 1.5, 0.5, 1.5, 1.5, E13])))
    # seq 2: μ = 0.25, σ = sqrt((5·0.0225 + 0.5625)/6) = 0.33541, thr = 0.92082 → onset {1} as before
    assert a.last_segments[2].tolist() == segs((1, 2))
    a1, out1, _ = run(onset_rule="zscore", z_k=1.0)
    a0, out0, _ = run()
    assert torch.equal(a1.last_segments, a0.last_segments)
    assert_close_to(out1.token_advantages, out0.token_advantages)


def test_d_min_floor_and_constant_divergence():
    batch, sig = make_batch()
    sig[Signal.TEACHER_KL] = torch.full((5, T), 0.01) * batch.response_mask  # below d_min: no onset
    a = v1()
    out = a.assign(batch, ADV, sig)
    assert (a.last_segments == -1).all()
    assert_close_to(out.token_advantages, ADV[:, None] * batch.response_mask.float())  # g ≡ 1 → w ≡ 1
    sig[Signal.TEACHER_KL] = torch.zeros(5, T)  # teacher ≡ student: mean 0 → g ≡ 1
    out = a.assign(batch, ADV, sig)
    assert_close_to(out.token_advantages, ADV[:, None] * batch.response_mask.float())
    # a large floor removes the onsets of seq 0 although they are quantile peaks
    batch, sig = make_batch()
    a = v1({"d_min": 1.5})
    a.assign(batch, ADV, sig)
    assert (a.last_segments == -1).all()


def test_local_max_option():
    batch, sig = make_batch()
    d = sig[Signal.TEACHER_KL].clone()
    d[0, :10] = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.9, 1.0])
    sig[Signal.TEACHER_KL] = d
    # sorted 0.1×8, 0.9, 1.0; pos 8.1 → Q = 0.9 + 0.1·0.1 = 0.91 → only t9 qualifies either way; with q_on = 0.8:
    # pos 7.2 → Q = 0.1 + 0.2·0.8 = 0.26 → t8 (0.9) and t9 (1.0) pass; t8 is no local max (t9 > t8)
    a = v1({"q_on": 0.8})
    a.assign(batch, ADV, sig)
    assert a.last_onsets[0].nonzero().flatten().tolist() == [9]
    a = v1({"q_on": 0.8, "onset_local_max": False})
    a.assign(batch, ADV, sig)
    assert a.last_onsets[0].nonzero().flatten().tolist() == [8, 9]
    assert a.last_segments[0].tolist() == segs((8, 8), (9, 9))  # the next onset ends a segment


def test_exclude_last_tokens():
    a, _, _ = run(exclude_last_tokens=4)
    # seq 0: t6..t9 (last 4 generated; padding not counted) leave the pool: d = .1 .1 1 .2 .1 .1,
    # sorted .1×4, .2, 1 → pos 4.5 → Q = .2 + .5·.8 = .6 → onset {2} only; its segment [2, 4] is unchanged
    assert a.last_segments[0].tolist() == segs((2, 4))
    # seq 3: generated t0 t1 t2 | t5 t6 t7 → the last 4 are t2, t5, t6, t7; pool t0, t1 (0.1, 0.1):
    # Q = 0.1 ≥ d_min, both tie as local maxima → onsets {0, 1}; t1 ends t0's segment, t2 (H 0.1 < τ_H 0.2) joins t1's
    assert a.last_segments[3].tolist() == segs((0, 0), (1, 2))


def test_teacher_entropy_source_and_needs():
    batch, sig = make_batch()
    a = v1({"entropy_source": "teacher"})
    assert a.needs == {Signal.TEACHER_KL, Signal.TEACHER_ENTROPY}
    out = a.assign(batch, ADV, {Signal.TEACHER_KL: sig[Signal.TEACHER_KL], Signal.TEACHER_ENTROPY: sig[Signal.ENTROPY]})
    ref = v1().assign(batch, ADV, sig)
    assert_close_to(out.token_advantages, ref.token_advantages)
    assert GEARAssigner.needs == {Signal.TEACHER_KL, Signal.ENTROPY}
    assert v1({"exclude_answer_span": True}).needs == {Signal.TEACHER_KL, Signal.ENTROPY, Signal.REASONING_MASK}
    # guard on by default
    assert credit.build("gear").needs == {Signal.TEACHER_KL, Signal.ENTROPY, Signal.REASONING_MASK}
    with pytest.raises(ValueError, match="teacher_entropy"):
        a.assign(batch, ADV, sig)


def test_exclude_answer_span_uses_reasoning_mask():
    batch, sig = make_batch()
    rm = batch.response_mask.float().clone()
    rm[0, 6:] = 0  # seq 0: final-answer span t6..t9 → same pool as exclude_last_tokens=4
    a = v1({"exclude_answer_span": True})
    a.assign(batch, ADV, {**sig, Signal.REASONING_MASK: rm})
    assert a.last_segments[0].tolist() == segs((2, 4))


def test_teacher_attributes():
    a = v1({"teacher_mode": "ema", "teacher_ema": 0.9, "teacher_context": "solution"})
    assert (a.teacher_mode, a.teacher_ema, a.teacher_context) == ("ema", 0.9, "solution")
    a = v1({"teacher_mode": "frozen", "teacher_sync_every": 10})
    assert (a.teacher_mode, a.teacher_sync_every) == ("frozen", 10)
    a = v1()
    assert (a.teacher_mode, a.teacher_context, a.preserves_sign, a.preserves_mass) == ("live", "answer", True, True)


@pytest.mark.parametrize("opts, match", [
    ({"eps_w": 1.0}, "eps_w"), ({"eps_w": 1.5}, "eps_w"), ({"eps_w": -0.1}, "eps_w"),
    ({"divergence": "topk"}, "divergence"), ({"onset_rule": "peak"}, "onset_rule"),
    ({"entropy_rule": "low"}, "entropy_rule"), ({"entropy_source": "both"}, "entropy_source"),
    ({"modulation": "linear"}, "modulation"), ({"normalisation": "token"}, "normalisation"),
    ({"teacher_mode": "lagged"}, "teacher_mode"), ({"teacher_context": "hint"}, "teacher_context"),
    ({"q_on": 1.5}, "q_on"), ({"q_h": -0.1}, "q_h"), ({"d_min": -1.0}, "d_min"), ({"beta": -1.0}, "beta"),
    ({"l_max": 0}, "l_max"), ({"l_max": 2.5}, "l_max"), ({"exclude_last_tokens": -1}, "exclude_last_tokens"),
    ({"teacher_sync_every": -1}, "teacher_sync_every"), ({"teacher_ema": 1.5}, "teacher_ema"),
    ({"clamp_sampled": "yes"}, "clamp_sampled"), ({"z_k": float("nan")}, "z_k"), ({"no_such_option": 1}, "gear"),
])
def test_option_validation(opts, match):
    with pytest.raises(ValueError, match=match):
        v1(opts)


def test_yaml_and_class_cannot_disagree_on_defaults():
    """The defaults live in one place, the Options dataclass: the YAML names the method and sets none of them."""
    conf = OmegaConf.to_container(OmegaConf.load(Path(__file__).parents[2] / "conf" / "assigner" / "gear.yaml"))
    assert conf["name"] == "gear" and conf["options"] == {}
    defaults = {f.name: f.default for f in dataclasses.fields(GEARAssigner.Options)}
    a = credit.build("gear", conf["options"])
    assert {k: getattr(a, k) for k in defaults} == defaults and len(defaults) == 26  # 21 + scale, d_scale + 3 controls
    assert (a.modulation, a.scale, a.exclude_answer_span) == ("tanh", "group", True)
    assert "gear" in credit.available()


# ================================================================================== controls
# segmentation = random | fixed (docs/credit/controls.md): GEAR's segments (their count and weights, and for
# `random` their lengths) moved to positions that carry no information. A batch with planted divergence peaks:
# background d = 0.01 < d_min, so the onsets are exactly the peaks (the q_on-quantile is the background value and
# the floor removes it); H = 1.0 except 0.1 on the tokens right after a peak, so τ_H = 1.0 (the q_h-quantile) and a
# GEAR segment is the peak plus its low-entropy tail.
TC = 32
CTRL = {"beta": 0.05, "eps_w": 0.9, "normalisation": "none"}  # raw weights, distinct per segment, inside the clip
ADV_C = torch.tensor([1.0, -1.0, 0.5, 0.0])
# row 0 (A = +1): generated t0..t29. Peaks t5 = 0.6 (tail t6..t8), t20 = 0.3 (tail t21)
#   → GEAR segments [5, 8] (4 tokens), [20, 21] (2).
# row 1 (A = −1): generated t0..t9 and t12..t29, t10..t11 tool text (masked). Peaks t3 = 0.5 (tail t4), t16 = 0.25
#   (tail t17..t19) → [3, 4] (2), [16, 19] (4). N = 28.
# row 2 (A = +0.5): generated t0..t23; turn 0 = t0..t9, turn 1 = t10..t23. Peaks t2 = 0.8 (tail t3, t4),
#   t14 = 0.4 (tail t15) → [2, 4] (3), [14, 15] (2). N = 24.
# row 3 (A = 0): row 0's signals → no segments.
PEAKS = {0: {5: 0.6, 20: 0.3}, 1: {3: 0.5, 16: 0.25}, 2: {2: 0.8, 14: 0.4}, 3: {5: 0.6, 20: 0.3}}
TAILS = {0: [6, 7, 8, 21], 1: [4, 17, 18, 19], 2: [3, 4, 15], 3: [6, 7, 8, 21]}
GEAR_SEGS = {0: [(5, 8), (20, 21)], 1: [(3, 4), (16, 19)], 2: [(2, 4), (14, 15)], 3: []}


def make_ctrl_batch() -> tuple[RolloutBatch, dict[Signal, torch.Tensor]]:
    resp = torch.zeros(4, TC, dtype=torch.bool)
    resp[0, :30] = resp[3, :30] = True
    resp[1, :10] = resp[1, 12:30] = True
    resp[2, :24] = True
    attn = resp.clone()
    attn[1, 10:12] = True  # tool text: a real response token, not generated
    turn_ids = torch.zeros(4, TC, dtype=torch.long)
    turn_ids[2, 10:] = 1
    d = torch.full((4, TC), 0.01)
    H = torch.ones(4, TC)
    for r in range(4):
        for t, v in PEAKS[r].items():
            d[r, t] = v
        H[r, TAILS[r]] = 0.1
    k = torch.arange(4)[:, None]
    batch = RolloutBatch(prompt_ids=10 * k + torch.arange(3) + 3, prompt_mask=torch.ones(4, 3, dtype=torch.long),
                         response_ids=(torch.arange(TC) * (k + 2) + 5 * k) % 97 + 3, response_mask=resp,
                         attention_mask=attn, group_ids=torch.tensor([0, 0, 1, 1]),
                         rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]), turn_ids=turn_ids)
    return batch, {Signal.TEACHER_KL: d * resp, Signal.ENTROPY: H * resp}


def ctrl_weights(row: int, segments: list[tuple[int, int, float]], batch: RolloutBatch, sig) -> list[float]:
    """Hand weights of one row under CTRL: g_t = d_t / mean(d) per token, g = G inside each (first, last, G)
    segment, w = clip(exp(−sign(A)·0.05·(g − 1)), 0.1, 1.9), 0 on masked tokens (no normalisation)."""
    m = batch.response_mask[row].tolist()
    d = sig[Signal.TEACHER_KL][row].double().tolist()
    mean = sum(x for x, keep in zip(d, m) if keep) / sum(m)
    g = [x / mean for x in d]
    for s, e, G in segments:
        g[s:e + 1] = [G] * (e - s + 1)
    sgn = math.copysign(1.0, float(ADV_C[row]))
    return [min(max(math.exp(-sgn * 0.05 * (x - 1.0)), 0.1), 1.9) if keep else 0.0 for x, keep in zip(g, m)]


def onset_g(row: int, t: int, batch: RolloutBatch, sig) -> float:
    m = batch.response_mask[row]
    d = sig[Signal.TEACHER_KL][row].double()
    return float(d[t] / d[m].mean())


def seg_list(row_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(first, last) of every segment of a last_segments row, by id."""
    out = []
    for k in range(int(row_ids.max()) + 1 if (row_ids >= 0).any() else 0):
        idx = (row_ids == k).nonzero().flatten()
        out.append((int(idx[0]), int(idx[-1])))
    return out


def run_ctrl(batch=None, sig=None, adv=ADV_C, **opts):
    if batch is None:
        batch, sig = make_ctrl_batch()
    a = v1({**CTRL, **opts})
    return a, a.assign(batch, adv, sig), batch, sig


def test_controls_default_is_adaptive_and_unchanged():
    assert credit.build("gear").segmentation == "adaptive" and GEARAssigner.Options().segmentation == "adaptive"
    a0, out0, _ = run()
    a1, out1, _ = run(segmentation="adaptive")
    assert torch.equal(out0.token_advantages, out1.token_advantages) and torch.equal(a0.last_segments, a1.last_segments)
    # the numbers pinned by test_default_reading_a_hand_values
    assert a1.last_segments.tolist()[:2] == [segs((2, 4), (6, 6)), segs((2, 4), (6, 6))]
    assert_close_to(out1.token_advantages[0], _pad(normed(SEQ0_A)))
    assert_close_to(out1.token_advantages[2], _pad([0.5 * x for x in [9 / 7, 3 / 7, 3 / 7, 9 / 7, 9 / 7, 9 / 7]]))
    assert_close_to(out1.metrics["segments_per_seq"], 6 / 4)


def test_control_batch_gear_segments():
    """The planted peaks give the segments the comments say (what the controls start from)."""
    a, _, batch, sig = run_ctrl()
    assert [seg_list(a.last_segments[r]) for r in range(4)] == [GEAR_SEGS[r] for r in range(4)]
    for r in range(3):
        want = ctrl_weights(r, [(s, e, onset_g(r, s, batch, sig)) for s, e in GEAR_SEGS[r]], batch, sig)
        assert_close_to(a.last_weights[r], want)


def test_fixed_puts_gears_segments_at_regular_onsets():
    a, out, batch, sig = run_ctrl(segmentation="fixed")
    # k = 2 per row, onset j at generated index floor(j·N/k), length = the row's mean GEAR length, rounded half up:
    # row 0: N = 30 → t0, t15; mean (4 + 2)/2 = 3. row 1: N = 28 → index 14 = t16 (t10, t11 are not generated);
    # mean 3. row 2: N = 24 → t0, t12; mean 2.5 → 3.
    want = {0: [(0, 2), (15, 17)], 1: [(0, 2), (16, 18)], 2: [(0, 2), (12, 14)], 3: []}
    assert [seg_list(a.last_segments[r]) for r in range(4)] == [want[r] for r in range(4)]
    assert a.last_onsets.nonzero().tolist() == [[0, 0], [0, 15], [1, 0], [1, 16], [2, 0], [2, 12]]
    for r in range(3):  # GEAR's weights, in GEAR's order
        gear_g = [onset_g(r, s, batch, sig) for s, _ in GEAR_SEGS[r]]
        want_w = ctrl_weights(r, [(s, e, G) for (s, e), G in zip(want[r], gear_g)], batch, sig)
        assert_close_to(a.last_weights[r], want_w)
        assert_close_to(out.token_advantages[r], [x * float(ADV_C[r]) for x in want_w])
    assert out.token_advantages[3].abs().sum() == 0
    assert_close_to(out.metrics["segments_per_seq"], 2.0)
    assert_close_to(out.metrics["segment_len_mean"], 3.0)
    assert_close_to(out.metrics["frac_tokens_in_segments"], 18 / 82)


def test_fixed_len_truncates_at_masked_tokens_turns_and_the_next_onset():
    a, _, _, _ = run_ctrl(segmentation="fixed", fixed_len=20)
    # row 0: [0, 19] stops before the next onset t15; row 1: stops before the tool text t10;
    # row 2: stops at the turn change t9 → t10; the second segments run to the last generated token
    assert [seg_list(a.last_segments[r]) for r in range(3)] == [[(0, 14), (15, 29)], [(0, 9), (16, 29)],
                                                               [(0, 9), (12, 23)]]
    # a fixed length makes GEAR's own lengths (the entropy) irrelevant: the signal is no longer needed
    assert a.needs == {Signal.TEACHER_KL}
    assert v1({"segmentation": "fixed"}).needs == {Signal.TEACHER_KL, Signal.ENTROPY}
    a2, _, _, _ = run_ctrl(segmentation="fixed", fixed_len=1)
    assert [seg_list(a2.last_segments[r]) for r in range(3)] == [[(0, 0), (15, 15)], [(0, 0), (16, 16)],
                                                                [(0, 0), (12, 12)]]


def _pairs(a, r, batch, sig):
    """(length, weight) of every segment of row r, and the sorted in-segment weights."""
    seg = a.last_segments[r]
    w = a.last_weights[r].double()
    pairs = sorted((e - s + 1, round(float(w[s]), 9)) for s, e in seg_list(seg))
    return pairs, sorted(w[seg >= 0].tolist())


def test_random_keeps_count_lengths_and_weights_moves_the_onsets():
    g, out_g, batch, sig = run_ctrl()
    a, out, _, _ = run_ctrl(segmentation="random")
    for r in range(3):
        gear_segs = seg_list(g.last_segments[r])
        ctrl_segs = seg_list(a.last_segments[r])
        assert len(ctrl_segs) == len(gear_segs) == 2
        # whole, no truncation
        assert sorted(e - s + 1 for s, e in ctrl_segs) == sorted(e - s + 1 for s, e in gear_segs)
        assert ctrl_segs != gear_segs  # moved
        # each segment carries its own GEAR weight (length and weight move together); same in-segment multiset
        assert _pairs(a, r, batch, sig) == _pairs(g, r, batch, sig)
        # the placed segments follow the rules: generated tokens, one turn, no overlap (ids are disjoint)
        seg = a.last_segments[r]
        assert batch.response_mask[r][seg >= 0].all()
        for s, e in ctrl_segs:
            assert batch.turn_ids[r, s:e + 1].unique().numel() == 1 and batch.response_mask[r, s:e + 1].all()
        assert a.last_onsets[r].nonzero().flatten().tolist() == [s for s, _ in ctrl_segs]
        # tokens outside the control's segments keep their per-token GEAR weight
        per_tok = ctrl_weights(r, [], batch, sig)
        outside = (seg < 0) & batch.response_mask[r]
        assert_close_to(a.last_weights[r][outside], torch.tensor(per_tok)[outside])
    assert (a.last_segments[3] == -1).all() and out.token_advantages[3].abs().sum() == 0
    assert_close_to(out.metrics["segments_per_seq"], 2.0)
    assert_close_to(out.metrics["segment_len_mean"], 17 / 6)


def test_random_is_seeded_per_row_not_per_batch():
    batch, sig = make_ctrl_batch()
    a, out, _, _ = run_ctrl(batch, sig, segmentation="random")
    idx = torch.tensor([2, 0, 3, 1])
    b, o, _, _ = run_ctrl(batch.select(idx), {k: v[idx] for k, v in sig.items()}, ADV_C[idx], segmentation="random")
    assert torch.equal(b.last_segments, a.last_segments[idx])
    assert torch.equal(o.token_advantages, out.token_advantages[idx])
    one = torch.tensor([1])
    c, _, _, _ = run_ctrl(batch.select(one), {k: v[one] for k, v in sig.items()}, ADV_C[one], segmentation="random")
    assert torch.equal(c.last_segments[0], a.last_segments[1])
    # padding does not enter the seed: the same rows padded to a longer T are placed the same way
    wide = batch.with_(response_ids=torch.cat([batch.response_ids, torch.full((4, 5), 7)], 1),
                       response_mask=torch.cat([batch.response_mask, torch.zeros(4, 5, dtype=torch.bool)], 1),
                       attention_mask=torch.cat([batch.attention_mask, torch.zeros(4, 5, dtype=torch.bool)], 1),
                       turn_ids=torch.cat([batch.turn_ids, batch.turn_ids[:, -1:].expand(4, 5)], 1))
    w, _, _, _ = run_ctrl(
        wide, {k: torch.cat([v, torch.zeros(4, 5)], 1) for k, v in sig.items()}, segmentation="random"
    )
    assert torch.equal(w.last_segments[:, :TC], a.last_segments)
    # another control_seed places them elsewhere
    s, _, _, _ = run_ctrl(batch, sig, segmentation="random", control_seed=1)
    assert not torch.equal(s.last_segments, a.last_segments)


def test_random_keeps_gears_promises():
    batch, sig = make_ctrl_batch()
    a = v1({"segmentation": "random"})
    assert a.preserves_sign and a.preserves_mass
    out = a.assign(batch, ADV_C, sig)
    adv = out.token_advantages
    N = batch.response_mask.sum(1).double()
    assert_close_to(adv.double().sum(1), N * ADV_C.double(), atol=1e-5)
    gen = batch.response_mask & (ADV_C != 0)[:, None]
    assert (torch.sign(adv)[gen] == torch.sign(ADV_C)[:, None].expand_as(adv)[gen]).all()
    assert (adv[~batch.response_mask] == 0).all()


@pytest.mark.parametrize("opts", [{"segmentation": "random"}, {"segmentation": "fixed"},
                                  {"segmentation": "fixed", "fixed_len": 3}, {"segmentation": "random",
                                  "control_seed": 7},
                                  {"segmentation": "random", "entropy_rule": "high_continues",
                                  "normalisation": "sequence"}])
def test_controls_pass_the_contract_kit(opts):
    from gearlab.credit.contract import check_assigner

    checks = check_assigner("gear", opts)
    assert {c.name for c in checks} >= {"sign preserved", "mass preserved (Σ_t A_t = N·A)", "declared signals are used",
                                        "segments stay within a turn and on generated tokens", "deterministic"}
    assert all(c.ok for c in checks), [(c.name, c.detail) for c in checks if not c.ok]


def test_control_variants_resolve_and_pass_check_assigner():
    import subprocess
    import sys

    from gearlab.credit.methods import method_spec

    root = Path(__file__).parents[2]
    for name, opts in [("gear_random", {"segmentation": "random"}), ("gear_fixed", {"segmentation": "fixed"})]:
        conf = OmegaConf.to_container(OmegaConf.load(root / "conf" / "assigner" / f"{name}.yaml"))
        assert conf == {"name": name, "base": "gear", "options": opts}
        spec = method_spec(name)
        assert (spec.base, spec.options) == ("gear", opts)
    out = subprocess.run([sys.executable, "-m", "gearlab.cli", "check-assigner", "gear_random"], capture_output=True,
                         text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAIL" not in out.stdout and "gear_random: 9/9 checks passed" in out.stdout


@pytest.mark.parametrize("opts, match", [({"segmentation": "shuffled"}, "segmentation"), ({"fixed_len": -1},
                                         "fixed_len"),
                                         ({"control_seed": 1.5}, "control_seed")])
def test_control_option_validation(opts, match):
    with pytest.raises(ValueError, match=match):
        v1(opts)


# ================================================================================== modulation=tanh (the default)
# w = 1 − sign(A)·ε_w·tanh(β·s), s = log1p(max(0, d − d_min)/c), c = the median excess over the group's onsets;
# s held at the onset inside a segment; no onset in a response → w ≡ 1. The planted batch of the controls:
# background d = 0.01 < d_min, so every token outside a segment has s = 0.
#   group 0 (rows 0, 1): onset excesses 0.55, 0.25 (row 0), 0.45, 0.20 (row 1) → sorted .20 .25 .45 .55 → c = 0.35
#   group 1 (row 2; row 3 has A = 0): 0.75, 0.35 → c = 0.55
SCALE = {0: 0.35, 1: 0.35, 2: 0.55}


def tanh_w(excess: float, c: float, sign: float, beta: float = 1.0, eps: float = 0.5) -> float:
    return 1.0 - sign * eps * math.tanh(beta * math.log1p(excess / c))


def run_tanh(batch=None, sig=None, adv=ADV_C, **opts):
    """Default GEAR on the planted batch; the answer-leak guard gets a reasoning mask covering every generated token."""
    if batch is None:
        batch, sig = make_ctrl_batch()
    sig = {Signal.REASONING_MASK: batch.response_mask.float(), **sig}
    a = credit.build("gear", opts)
    return a, a.assign(batch, adv, sig), batch, sig


def tanh_row(row: int, batch, sig, c: float, beta: float = 1.0, sign: float | None = None) -> list[float]:
    """Hand weights of a planted row before normalisation: each GEAR segment at its onset's weight, 1 elsewhere."""
    w = [1.0 if m else 0.0 for m in batch.response_mask[row].tolist()]
    sgn = math.copysign(1.0, float(ADV_C[row])) if sign is None else sign
    for s, e in GEAR_SEGS[row]:
        excess = float(sig[Signal.TEACHER_KL][row, s]) - 0.05
        w[s:e + 1] = [tanh_w(excess, c, sgn, beta)] * (e - s + 1)
    return w


def test_tanh_hand_values():
    a, out, batch, sig = run_tanh(normalisation="none")
    assert [seg_list(a.last_segments[r]) for r in range(4)] == [GEAR_SEGS[r] for r in range(4)]
    for r in range(3):
        want = tanh_row(r, batch, sig, SCALE[r])
        assert_close_to(a.last_weights[r], want)
        assert_close_to(out.token_advantages[r], [x * float(ADV_C[r]) for x in want])
    # e.g. row 0 (A = +1), the 0.6 peak: s = log1p(0.55/0.35) = 0.9445 → w = 1 − 0.5·tanh(0.9445) = 0.6314
    assert_close_to(a.last_weights[0, 5], 0.631367, atol=1e-6)
    assert out.token_advantages[3].abs().sum() == 0
    # with the default per-sequence normalisation: w·N/Σw, N = 30, 28, 24
    _, out, _, _ = run_tanh()
    for r in range(3):
        assert_close_to(
            out.token_advantages[r], [x * float(ADV_C[r]) for x in normed(tanh_row(r, batch, sig, SCALE[r]))]
        )
    assert out.metrics["gear_clip_frac"] == 0.0


def test_departure_size_sets_the_segment_weight():
    """Two failed responses of one group that differ only in the size of their departure get different segment
    weights, the larger departure the larger blame (and, succeeded, the smaller credit), monotonically."""
    B, n = 6, 20
    d = torch.full((B, n), 0.01)
    peaks = [0.1, 0.2, 0.4, 0.8, 1.6, 3.2]
    for r, p in enumerate(peaks):
        d[r, 7] = p
    H = torch.ones(B, n)
    batch = RolloutBatch(prompt_ids=torch.ones(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.long),
                         response_ids=torch.ones(B, n, dtype=torch.long), response_mask=torch.ones(B, n,
                         dtype=torch.bool),
                         group_ids=torch.zeros(B, dtype=torch.long), rewards=torch.zeros(B))
    sig = {Signal.TEACHER_KL: d, Signal.ENTROPY: H, Signal.REASONING_MASK: torch.ones(B, n)}
    for sign in (-1.0, 1.0):
        a = credit.build("gear", {"normalisation": "none"})
        a.assign(batch, torch.full((B,), sign), sig)
        seg_w = a.last_weights[:, 7].double()
        assert (a.last_onsets.sum(1) == 1).all()
        steps = seg_w[1:] - seg_w[:-1]
        assert ((-sign * steps) > 1e-3).all(), seg_w  # strictly monotone in the departure, none saturated
        c = (0.4 + 0.8) / 2 - 0.05  # the median of the 6 excesses (peaks − 0.05)
        assert_close_to(seg_w, [tanh_w(p - 0.05, c, sign) for p in peaks])
        assert_close_to(a.last_weights[:, :7], torch.ones(B, 7))  # sub-floor tokens untouched
    # the first reconstruction gave the two smallest departures of a failed response the same clipped weight
    a = v1({"normalisation": "none"})
    a.assign(batch, torch.full((B,), -1.0), {k: v for k, v in sig.items() if k != Signal.REASONING_MASK})
    assert torch.equal(a.last_weights[:, 7], torch.full((B,), 1.5))


def test_aligned_response_keeps_its_grpo_advantage():
    """The reproduction of the audit: a response that never departs (every d ≤ 0.01 nats) is not reweighted."""
    d = torch.tensor([[.001, .004, .002, .010, .003, .001, .002, .001]])
    batch = RolloutBatch(prompt_ids=torch.ones(1, 1, dtype=torch.long), prompt_mask=torch.ones(1, 1, dtype=torch.long),
                         response_ids=torch.ones(1, 8, dtype=torch.long), response_mask=torch.ones(1, 8,
                         dtype=torch.bool),
                         group_ids=torch.tensor([0]), rewards=torch.tensor([1.0]))
    H = torch.rand(1, 8, generator=torch.Generator().manual_seed(0))
    sig = {Signal.TEACHER_KL: d, Signal.ENTROPY: H, Signal.REASONING_MASK: torch.ones(1, 8)}
    for opts in ({}, {"onset_rule": "zscore", "z_k": 3.0}, {"scale": "batch"}, {"normalisation": "none"}):
        a = credit.build("gear", opts)
        out = a.assign(batch, torch.tensor([1.0]), sig)
        assert not a.last_onsets.any() and torch.equal(out.token_advantages, torch.ones(1, 8)), opts
    # the absolute floor is what keeps it out: without it the 0.010-nat bump at t3 is an onset and credit moves
    a = credit.build("gear", {"d_min": 0.0})
    out = a.assign(batch, torch.tensor([1.0]), sig)
    assert a.last_onsets[0].nonzero().flatten().tolist() == [3]
    assert (out.token_advantages - 1).abs().max() > 0.1 and float(out.token_advantages.sum()) == pytest.approx(8.0)
    out = credit.build("gear").assign(batch, torch.tensor([1.0]), sig)
    assert torch.equal(out.token_advantages, torch.ones(1, 8))
    # the first reconstruction spread these weights by noise (the audit's numbers)
    out = v1().assign(batch, torch.tensor([1.0]), {Signal.TEACHER_KL: d, Signal.ENTROPY: H})
    assert_close_to(out.token_advantages[0], [1.262, 0.603, 1.174, 0.421, 0.841, 1.262, 1.174, 1.262], atol=1e-3)


def test_sub_floor_noise_outside_segments_does_not_move_credit():
    batch, sig = make_ctrl_batch()
    _, ref, _, _ = run_tanh(batch, sig)
    noisy = dict(sig)
    noise = torch.rand(4, TC, generator=torch.Generator().manual_seed(1)) * 0.039  # 0.01 + noise < d_min = 0.05
    for r in range(4):
        for t in PEAKS[r]:
            noise[r, t] = 0.0
    noisy[Signal.TEACHER_KL] = (sig[Signal.TEACHER_KL] + noise * (sig[Signal.TEACHER_KL] < 0.05)) * batch.response_mask
    a, out, _, _ = run_tanh(batch, noisy)
    assert [seg_list(a.last_segments[r]) for r in range(4)] == [GEAR_SEGS[r] for r in range(4)]
    assert_close_to(out.token_advantages, ref.token_advantages, atol=1e-12)
    # above the floor, a token outside the segments is weighted by its own absolute divergence: row 0 gets t12 = 0.2
    # (a local max above the 0.9-quantile 0.11: a new onset; H = 1 there, so its segment is t12 alone) and t13 = 0.1
    # (under the quantile: no onset, s = log1p(0.05/c)); group 0's excesses .55 .25 .15 | .45 .20 → c = 0.25
    dd = sig[Signal.TEACHER_KL].clone()
    dd[0, 12], dd[0, 13] = 0.2, 0.1
    a, _, _, _ = run_tanh(batch, {**sig, Signal.TEACHER_KL: dd}, normalisation="none")
    assert seg_list(a.last_segments[0]) == [(5, 8), (12, 12), (20, 21)]
    assert_close_to(a.last_weights[0, 12:14], [tanh_w(0.15, 0.25, 1.0), tanh_w(0.05, 0.25, 1.0)])
    assert_close_to(a.last_weights[0, 14:20], [1.0] * 6)


def test_answer_span_guard_is_on_by_default():
    batch, sig = make_ctrl_batch()
    rm = batch.response_mask.float().clone()
    rm[0, 18:] = 0  # row 0: its second peak (t20) lies in the final-answer span
    a, out, _, _ = run_tanh(batch, {**sig, Signal.REASONING_MASK: rm}, normalisation="none")
    assert seg_list(a.last_segments[0]) == [(5, 8)]
    # group 0's scale now pools 0.55 (row 0) and 0.45, 0.20 (row 1) → c = 0.45; t20's own strength is 0 (guarded)
    want = [1.0] * 30 + [0.0, 0.0]
    want[5:9] = [tanh_w(0.55, 0.45, 1.0)] * 4
    assert_close_to(a.last_weights[0], want)
    # a response whose only departure is in the answer span keeps its GRPO advantage
    rm[1, :] = 0
    a, out, _, _ = run_tanh(batch, {**sig, Signal.REASONING_MASK: rm})
    assert_close_to(out.token_advantages[1], -batch.response_mask[1].float())
    off, _, _, _ = run_tanh(batch, {**sig, Signal.REASONING_MASK: rm}, exclude_answer_span=False)
    assert seg_list(off.last_segments[0]) == GEAR_SEGS[0]


def test_scale_options():
    batch, sig = make_ctrl_batch()
    a, _, _, _ = run_tanh(batch, sig, normalisation="none", scale="batch")
    # every onset of the batch (rows 0–2): .55 .25 .45 .20 .75 .35 → sorted .20 .25 .35 .45 .55 .75 → c = 0.40
    for r in range(3):
        assert_close_to(a.last_weights[r], tanh_row(r, batch, sig, 0.40))
    a, _, _, _ = run_tanh(batch, sig, normalisation="none", scale="absolute", d_scale=0.2)
    for r in range(3):
        assert_close_to(a.last_weights[r], tanh_row(r, batch, sig, 0.2))
    a, _, _, _ = run_tanh(batch, sig, normalisation="none", beta=2.0)
    assert_close_to(a.last_weights[1], tanh_row(1, batch, sig, 0.35, beta=2.0))
    a, _, _, _ = run_tanh(batch, sig, normalisation="none", modulation="tanh_unsigned")
    assert_close_to(a.last_weights[1], tanh_row(1, batch, sig, 0.35, sign=1.0))  # A < 0 gets the A > 0 form
    # a group scale is a property of the group: the same group alone gives the same weights (rank-split invariance)
    g0 = torch.tensor([0, 1])
    b, _, _, _ = run_tanh(batch.select(g0), {k: v[g0] for k, v in sig.items()}, ADV_C[g0])
    full, _, _, _ = run_tanh(batch, sig)
    assert_close_to(b.last_weights, full.last_weights[g0])
    with pytest.raises(ValueError, match="scale"):
        credit.build("gear", {"scale": "token"})
    with pytest.raises(ValueError, match="d_scale"):
        credit.build("gear", {"d_scale": 0.0})


def test_clip_fraction_on_heavy_tailed_divergences():
    """The audit's finding and its fix: on exponential, lognormal and uniform divergences the first reconstruction's
    clip binds for ≥ 90% of segments; the default's weights stay off the bounds (≤ 10%, logged as gear_clip_frac)."""
    gen = torch.Generator().manual_seed(0)
    B, n = 64, 48
    batch = RolloutBatch(prompt_ids=torch.ones(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.long),
                         response_ids=torch.ones(B, n, dtype=torch.long), response_mask=torch.ones(B, n,
                         dtype=torch.bool),
                         group_ids=torch.arange(B) // 8, rewards=(torch.arange(B) % 3 == 0).float())
    from gearlab.core.grpo import group_advantages

    adv = group_advantages(batch.rewards, batch.group_ids)
    H = torch.rand(B, n, generator=gen)
    for d in (torch.empty(B, n).exponential_(5.0, generator=gen), torch.exp(torch.randn(B, n, generator=gen) - 2.0),
              torch.rand(B, n, generator=gen) * 0.5):
        sig = {Signal.TEACHER_KL: d, Signal.ENTROPY: H, Signal.REASONING_MASK: torch.ones(B, n)}
        new = credit.build("gear").assign(batch, adv, sig).metrics
        old = v1().assign(batch, adv, sig).metrics
        assert new["segments_per_seq"] > 1 and new["gear_clip_frac"] <= 0.10 and old["gear_clip_frac"] >= 0.90
