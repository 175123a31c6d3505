"""Tests of gearlab.grpo: hand-computed values, verl golden values, and the invariance of the
loss gradient to micro-batching and data parallelism."""
from __future__ import annotations

import gc
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gearlab.core.grpo import AGG_MODES, aggregate, group_advantages, kl_penalty, policy_loss, zero_std_fraction

TWO_GROUPS = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 0])
TWO_IDS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])


def assert_close_to(actual, expected, atol=1e-6, rtol=0.0):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=rtol)


# ----------------------------------------------------------------------------- advantages
def test_group_norm_hand_values():
    # [1,0,0,1]: mean 0.5; unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.5773503
    # A = +-0.5 / (0.5773503 + 1e-6) = +-0.8660239
    adv = group_advantages(torch.tensor([1.0, 0, 0, 1]), torch.zeros(4, dtype=torch.long))
    assert_close_to(adv, [0.8660239, -0.8660239, -0.8660239, 0.8660239])


def test_dr_grpo_and_rloo_hand_values():
    # group means 0.5 and 0.75; Dr.GRPO is R - mean.
    assert_close_to(group_advantages(TWO_GROUPS, TWO_IDS, scale_by_std=False),
          [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75])
    # RLOO: R - mean(others): 1 - 1/3, 0 - 2/3 | 1 - 2/3, 0 - 1 (= verl's RLOO row, docs/grpo.md#reference-values)
    assert_close_to(group_advantages(TWO_GROUPS, TWO_IDS, leave_one_out=True, scale_by_std=False),
          [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3, -1.0])


def test_batch_std_scope_hand_values():
    # batch mean 5/8; sum of squares 5 * 0.375^2 + 3 * 0.625^2 = 1.875; unbiased std sqrt(1.875/7)
    std = math.sqrt(1.875 / 7)
    adv = group_advantages(TWO_GROUPS, TWO_IDS, std_scope="batch", eps=1e-4)
    assert_close_to(adv, [x / (std + 1e-4) for x in [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]])


def test_singleton_all_equal_and_zero_std_fraction():
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 1.0, 0.0, 0.3, 0.3])
    ids = torch.tensor([5, 5, 5, 9, 2, 2, 7, 7])  # non-contiguous ids; group 9 is a singleton
    for loo in (False, True):
        adv = group_advantages(rewards, ids, leave_one_out=loo)
        assert torch.equal(adv[[0, 1, 2, 6, 7]], torch.zeros(5))  # all-equal groups: exactly 0
        assert torch.isfinite(adv).all()
        assert_close_to(adv[3], 0.7 / (1 + 1e-6))  # verl: singleton mean 0, std 1
        assert group_advantages(rewards, ids, leave_one_out=loo, singleton="zero")[3] == 0.0
    assert group_advantages(rewards, ids, scale_by_std=False)[3] == pytest.approx(0.7)
    # groups of size > 1: {5: all 0.1, 2: mixed, 7: all 0.3} -> 2 of 3 have zero std
    assert zero_std_fraction(rewards, ids) == pytest.approx(2 / 3)
    assert zero_std_fraction(torch.tensor([1.0, 0.0]), torch.tensor([0, 1])) == 0.0


def test_anchor_golden_advantage_rows():
    """docs/grpo.md#reference-values, rewards [1,0,0,1 | 1,1,1,0]."""
    assert_close_to(group_advantages(TWO_GROUPS, TWO_IDS),  # verl, eps 1e-6
          [0.866024, -0.866024, -0.866024, 0.866024, 0.499999, 0.499999, 0.499999, -1.499997])
    assert_close_to(group_advantages(TWO_GROUPS, TWO_IDS, eps=1e-4),  # TRL scale_rewards="group"
          [0.865875, -0.865875, -0.865875, 0.865875, 0.4999, 0.4999, 0.4999, -1.4997])
    assert_close_to(group_advantages(TWO_GROUPS, TWO_IDS, scale_by_std=False),  # verl Dr.GRPO
          [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75])
    # NeMo-RL leave-one-out. Group 1, R=1: others [0,0,1], mean 1/3, unbiased std 1/sqrt(3),
    # (2/3)/(0.57735+1e-6) = 1.154699. Group 2, R=1: others [1,1,0] -> (1/3)/0.57735 = 0.577349;
    # R=0: others [1,1,1] have std 0 -> no division -> 0 - 1 = -1.
    assert_close_to(group_advantages(TWO_GROUPS, TWO_IDS, leave_one_out=True),
          [1.154698, -1.154699, -1.154699, 1.154698, 0.577349, 0.577349, 0.577349, -1.0], atol=2e-6)


def _loop_reference(r, ids, scale, loo, eps=1e-6):
    out = torch.empty_like(r)
    for i in range(len(r)):
        grp = r[ids == ids[i]]
        if len(grp) == 1:
            out[i] = r[i] / (1 + eps) if scale else r[i]
            continue
        if loo:
            others = r[(ids == ids[i]) & (torch.arange(len(r)) != i)]
            a, s = r[i] - others.mean(), others.std() if len(others) > 1 else torch.tensor(0.0)
            out[i] = a / (s + eps) if scale and s > 0 else a
        else:
            out[i] = (r[i] - grp.mean()) / (grp.std() + eps) if scale else r[i] - grp.mean()
    return out


@pytest.mark.parametrize("scale,loo", [(True, False), (False, False), (True, True), (False, True)])
def test_vectorised_matches_loop(scale, loo):
    g = torch.Generator().manual_seed(3)
    sizes = torch.tensor([0] * 5 + [1] * 2 + [2] + [3] * 3 + [4] * 6 + [5] * 4)
    ids = sizes[torch.randperm(21, generator=g)] * 7  # shuffled, non-contiguous ids
    r = torch.rand(21, generator=g, dtype=torch.float64)
    r[::3] = (r[::3] > 0.5).double()
    assert_close_to(group_advantages(r, ids, scale_by_std=scale, leave_one_out=loo),
          _loop_reference(r, ids, scale, loo), atol=1e-10)


def test_group_std_is_correctly_rounded():
    # The float32 std must be the correctly rounded sqrt of the variance (as on a GPU): torch's CPU float32 sqrt is
    # off by one bit for ~8% of inputs and by another bit on Intel than on AMD, which moved every later digit of a
    # run between CPU classes (experiments/cpu_vml_probe.py).
    g = torch.Generator().manual_seed(0)
    r = torch.rand(4096, generator=g)  # 1024 groups of 4 with distinct variances
    ids = torch.arange(4096) // 4
    adv = group_advantages(r, ids, eps=0.0)
    for i in range(0, 4096, 4):
        grp = r[i:i + 4]
        dev = grp - grp.sum() / 4
        var = (dev * dev).sum() / 3  # the same float32 operations as group_advantages
        std = torch.tensor(math.sqrt(float(var)), dtype=torch.float32)  # correctly rounded
        assert torch.equal(adv[i:i + 4], dev / std), i


# ----------------------------------------------------------------------------- verl golden values
# Fixture of docs/grpo.md#reference-values, reconstructed: torch.manual_seed(0); old = -2 * torch.rand(8, 4);
# logp = old + 0.6 * (torch.rand(8, 4) - 0.5); ref = old + 0.1; response lengths [3,2,4,1,2,3,4,2];
# rewards [1,0,0,1 | 1,1,1,0]. Inlined (9 significant digits round-trip float32 exactly).
OLD = torch.tensor([
    [-0.99251318, -1.53644359, -0.176954865, -0.264060974],
    [-0.614845634, -1.26815736, -0.98018682, -1.79288948],
    [-0.911255956, -1.26461256, -0.697786927, -0.80343461],
    [-0.0446515083, -0.337717891, -0.587776899, -1.03704357],
    [-1.3953352, -1.60002279, -0.322058916, -0.564537168],
    [-1.36321712, -1.83038795, -0.794199824, -1.74831176],
    [-0.838816643, -1.1058141, -1.90547621, -0.0723296404],
    [-0.37046206, -0.746834755, -0.610200047, -1.8640008]])
LOGP = torch.tensor([
    [-1.18696713, -1.6745435, -0.386547029, -0.545029283],
    [-0.789967775, -1.01027799, -0.846321285, -1.64748764],
    [-0.895478487, -1.41841757, -0.647031546, -1.08354306],
    [-0.261421382, -0.492376894, -0.398495495, -0.861147165],
    [-1.52838373, -1.61084747, -0.1301907, -0.266297221],
    [-1.24415243, -1.78986013, -0.593053937, -1.92495251],
    [-0.782913446, -1.33840573, -2.11340213, -0.227304712],
    [-0.234720141, -0.626186609, -0.787905812, -1.77336872]])
MASK = torch.arange(4)[None, :] < torch.tensor([3, 2, 4, 1, 2, 3, 4, 2])[:, None]
# Expected numbers below were produced by running the real verl functions on this
# fixture: verl 0.9.1 compute_grpo_outcome_advantage / compute_policy_loss_vanilla (clip_ratio_low
# 0.2, clip_ratio_high 0.28, clip_ratio_c 3.0) / kl_penalty, and verl 0.7.0 for
# seq-mean-token-sum-norm (see aggregate's docstring). They round to docs/grpo.md#reference-values.
VERL_LOSS = {"token-mean": 0.058600880205631256, "seq-mean-token-sum": 0.15382730960845947,
             "seq-mean-token-mean": 0.0680113434791565,
             "seq-mean-token-sum-norm": 0.30765461921691895}
ANCHORS_LOSS = {"token-mean": 0.058601, "seq-mean-token-sum": 0.153827,
                "seq-mean-token-mean": 0.068011, "seq-mean-token-sum-norm": 0.307655}


def _verl_adv():
    return group_advantages(TWO_GROUPS, TWO_IDS)[:, None] * MASK


@pytest.mark.parametrize("agg", AGG_MODES)
def test_policy_loss_matches_verl(agg):
    loss, met = policy_loss(LOGP, OLD, _verl_adv(), MASK, clip_low=0.2, clip_high=0.28,
                            dual_clip=3.0, agg=agg)
    assert_close_to(loss, VERL_LOSS[agg], atol=1e-7)
    assert round(loss.item(), 6) == ANCHORS_LOSS[agg]
    assert_close_to(met["clipfrac"], 0.0476190485060215, atol=1e-8)  # verl pg_clipfrac (1 of 21 tokens)
    assert_close_to(met["clipfrac_low"], 1 / 21, atol=1e-7)
    assert_close_to(met["dual_clipfrac"], 0.0)  # verl pg_clipfrac_lower
    assert_close_to(met["approx_kl"], 0.0528511218726635, atol=1e-8)  # verl ppo_kl
    assert all(not v.requires_grad and v.dim() == 0 for v in met.values())


def test_sum_norm_verl_09_convention():
    # verl >= 0.8 also divides seq-mean-token-sum-norm by N_seq; verl 0.9.1 gives this value:
    loss, _ = policy_loss(LOGP, OLD, _verl_adv(), MASK, clip_high=0.28,
                          agg="seq-mean-token-sum-norm", loss_scale_factor=4 * 8)
    assert_close_to(loss, 0.03845682740211487, atol=1e-7)


def test_dual_clip_matches_verl():
    logp2 = OLD + 5 * (LOGP - OLD)  # ratios in e^[-1.5, 1.5]: both clips and the dual clip bind
    expected = {"token-mean": 0.34495407342910767, "seq-mean-token-mean": 0.4262009263038635}
    for agg, value in expected.items():
        loss, met = policy_loss(logp2, OLD, _verl_adv(), MASK, clip_high=0.28, dual_clip=3.0,
                                agg=agg)
        assert_close_to(loss, value, atol=1e-7)
        assert_close_to(met["clipfrac"], 0.2857142984867096, atol=1e-7)
        assert_close_to(met["dual_clipfrac"], 0.0476190485060215, atol=1e-7)
        assert_close_to(met["approx_kl"], 0.2642555236816406, atol=1e-7)
        assert_close_to(met["clipfrac_low"] + met["clipfrac_high"], met["clipfrac"])


def test_kl_matches_verl():
    ref = OLD + 0.1
    verl = {"k1": -0.1528511494398117, "k2": 0.024129575118422508, "k3": 0.026583177968859673,
            "abs": 0.18470637500286102}  # masked means, verl 0.9.1 kl_penalty
    for kind, value in verl.items():
        for k in (kind, kind + "+"):
            assert_close_to(aggregate(kl_penalty(LOGP, ref, k), MASK, "token-mean"), value, atol=1e-7)
    assert round(verl["k3"], 6) == 0.026583  # docs/grpo.md#reference-values


# ----------------------------------------------------------------------------- hand-computed loss
def test_dual_clip_hand_value_and_gradient():
    # A=-1, r=4: max(4, 1.2) = 4, capped at -A*3 = 3 (gradient 0)
    # A=-1, r=2: max(2, 1.2) = 2 < 3 (gradient r = 2)
    # A=+1, r=4: max(-4, -1.2) = -1.2, clipped, no dual clip for A > 0 (gradient 0)
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[4.0, 2.0, 4.0]])).requires_grad_()
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    loss, met = policy_loss(logp, old, adv, torch.ones(1, 3, dtype=torch.bool), dual_clip=3.0)
    assert_close_to(loss, (3 + 2 - 1.2) / 3)
    assert_close_to(met["dual_clipfrac"], 1 / 3)
    loss.backward()
    assert_close_to(logp.grad, [[0.0, 2 / 3, 0.0]])
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logp, old, adv, torch.ones(1, 3), dual_clip=1.0)


def test_clipfrac_hand_case():
    # (A, r): (1, 1.5) clipped high: -1.2 > -1.5 | (-1, 0.5) clipped low: 0.8 > 0.5
    # (1, 0.5): -0.8 < -0.5, unclipped | (-1, 1.5): 1.2 < 1.5, unclipped | (0, 2): equal | masked
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 0.0, 1.0]])
    r = torch.tensor([[1.5, 0.5, 0.5, 1.5, 2.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    loss, met = policy_loss(r.log(), torch.zeros(1, 6), adv, mask)
    assert_close_to(met["clipfrac"], 2 / 5)
    assert_close_to(met["clipfrac_high"], 1 / 5)
    assert_close_to(met["clipfrac_low"], 1 / 5)
    assert_close_to(met["ratio_mean"], (1.5 + 0.5 + 0.5 + 1.5 + 2.0) / 5)
    assert_close_to(loss, (-1.2 + 0.8 - 0.5 + 1.5 + 0.0) / 5)


def test_aggregate_modes_hand_values():
    # rows: [1,2,(3)] len 2, [4,5,6] len 3, [7,8,9] len 0 (masked out entirely, not counted)
    L = torch.arange(1.0, 10.0).view(3, 3)
    m = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert_close_to(aggregate(L, m, "token-mean"), 18 / 5)
    assert_close_to(aggregate(L, m, "seq-mean-token-mean"), (1.5 + 5) / 2)
    assert_close_to(aggregate(L, m, "seq-mean-token-sum"), 18 / 2)
    assert_close_to(aggregate(L, m, "seq-mean-token-sum-norm"), 18 / 3)  # T = 3, not divided by B
    assert_close_to(aggregate(L, m, "seq-mean-token-sum-norm", loss_scale_factor=6.0), 3.0)
    assert_close_to(aggregate(L, m, "token-mean", global_tokens=10, dp_size=2), 18 / 10 * 2)
    L[0, 2] = float("nan")  # padding may be garbage
    assert torch.isfinite(aggregate(L, m, "seq-mean-token-mean"))


def test_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="token-mean.*seq-mean-token-sum-norm"):
        aggregate(x, x, "seq-sum")
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        policy_loss(x, x, x, x, agg="mean")
    with pytest.raises(ValueError, match="global_tokens"):
        aggregate(x, x, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="global_seqs"):
        aggregate(x, x, "seq-mean-token-mean", dp_size=2)
    with pytest.raises(ValueError, match="k1.*low_var_kl"):
        kl_penalty(x, x, "k4")
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.long), std_scope="token")


# ----------------------------------------------------------------------------- KL estimators
def test_kl_kinds_hand_values():
    ref = torch.zeros(6)
    d = torch.tensor([0.5, -0.5, 0.0, 2.0, -30.0, 30.0])
    assert_close_to(kl_penalty(d, ref, "k1"), d)
    assert_close_to(kl_penalty(d, ref, "abs"), d.abs())
    assert_close_to(kl_penalty(d, ref, "k2"), [0.125, 0.125, 0.0, 2.0, 450.0, 450.0])
    # exp(-d) + d - 1: e^-0.5 - 0.5 = 0.1065307, e^0.5 - 1.5 = 0.1487213, 0, e^-2 + 1 = 1.1353353;
    # d = -30: -d clamped to 20, e^20 - 21 -> clamped to 10; d = 30: e^-20 + 19 -> 10.
    assert_close_to(kl_penalty(d, ref, "k3"), [0.1065307, 0.1487213, 0.0, 1.1353353, 10.0, 10.0])
    for alias, kind in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3"), ("low_var_kl+", "k3+")):
        assert_close_to(kl_penalty(d, ref, alias), kl_penalty(d, ref, kind))


@pytest.mark.parametrize("kind", ["k1+", "k2+", "k3+", "abs+", "low_var_kl+"])
def test_straight_through_has_k2_gradient(kind):
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 5, generator=g, dtype=torch.float64).requires_grad_()
    ref = torch.randn(3, 5, generator=g, dtype=torch.float64)
    w = torch.randn(3, 5, generator=g, dtype=torch.float64)
    value = kl_penalty(logp, ref, kind)
    # forward value unchanged
    assert torch.equal(value.detach(), kl_penalty(logp, ref, kind[:-1]).detach())
    (grad,) = torch.autograd.grad((value * w).sum(), logp)
    (grad_k2,) = torch.autograd.grad((kl_penalty(logp, ref, "k2") * w).sum(), logp)
    assert_close_to(grad, grad_k2, atol=1e-12)
    (grad_plain,) = torch.autograd.grad((kl_penalty(logp, ref, kind[:-1]) * w).sum(), logp)
    if kind != "k2+":
        assert not torch.allclose(grad_plain, grad_k2)  # so the check above has teeth


# ----------------------------------------------------------------------------- invariance
B, T = 8, 6
LENGTHS = torch.tensor([6, 1, 3, 0, 5, 2, 6, 4])  # ragged, one sequence fully masked


def _problem():
    g = torch.Generator().manual_seed(1)
    old = -2 * torch.rand(B, T, generator=g, dtype=torch.float64)
    logp = old + 1.6 * (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)
    ref = old + 0.4 * (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.arange(T)[None, :] < LENGTHS[:, None]
    return logp, old, ref, adv, mask


def _step_loss(logp, old, ref, adv, mask, rows, agg, counts, dp_size=1):
    kw = dict(dp_size=dp_size, **counts)
    pg, _ = policy_loss(logp[rows], old[rows], adv[rows], mask[rows], clip_high=0.28,
                        dual_clip=1.5, agg=agg, **kw)
    return pg + 0.1 * aggregate(kl_penalty(logp[rows], ref[rows], "k3"), mask[rows], agg, **kw)


def _accumulated_grad(logp, chunks, loss_fn):
    leaf = logp.clone().requires_grad_()
    for rows in chunks:
        loss_fn(leaf, rows).backward()  # .grad accumulates, as in gradient accumulation
    return leaf.grad


@pytest.mark.parametrize("agg", AGG_MODES)
def test_gradient_invariant_to_microbatches_and_ranks(agg):
    logp, old, ref, adv, mask = _problem()
    counts = dict(global_tokens=mask.sum(), global_seqs=(mask.sum(-1) > 0).sum())
    mbs = [slice(i, i + 2) for i in range(0, B, 2)]

    def loss(leaf, rows, dp=1, c=counts):
        return _step_loss(leaf, old, ref, adv, mask, rows, agg, c, dp)

    full = _accumulated_grad(logp, [slice(None)], lambda leaf, rows: loss(leaf, rows, c={}))
    ratio = (logp - old).exp()
    assert ((ratio > 1.5) & (adv < 0) & mask).any() and ((ratio > 1.28) & (adv > 0) & mask).any()
    # (a) 4 micro-batches of 2, one process
    assert_close_to(_accumulated_grad(logp, mbs, loss), full, atol=1e-12)
    # (b) 2 simulated ranks x 2 micro-batches each, dp_size=2, then DDP's average over ranks
    per_rank = [_accumulated_grad(logp, mbs[2 * k:2 * k + 2], lambda lf, rows: loss(lf, rows, dp=2))
                for k in range(2)]
    assert_close_to((per_rank[0] + per_rank[1]) / 2, full, atol=1e-12)
    if agg == "token-mean":  # the bug the global counts fix: per-micro-batch normalisation
        local = _accumulated_grad(logp, mbs, lambda leaf, rows: loss(leaf, rows, c={}))
        assert not torch.allclose(local, full, atol=1e-6)


# ----------------------------------------------------------------------------- real 2-process DDP
V, D = 5, 3


def _ddp_problem():
    g = torch.Generator().manual_seed(7)
    feats = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T), generator=g)
    policy = torch.nn.Linear(D, V).double()
    with torch.no_grad():
        policy.weight.copy_(torch.randn(V, D, generator=g))
        policy.bias.copy_(torch.randn(V, generator=g))
    with torch.no_grad():
        base = _token_logprobs(policy, feats, tokens)
    old = base + 0.8 * (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)
    ref = base + 0.2 * (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)
    rewards = (torch.rand(B, generator=g) > 0.5).double()
    mask = torch.arange(T)[None, :] < LENGTHS[:, None]
    adv = group_advantages(rewards, TWO_IDS)[:, None].expand(B, T)
    return policy, feats, tokens, old, ref, adv, mask


def _token_logprobs(model, feats, tokens):
    return torch.log_softmax(model(feats), -1).gather(-1, tokens[..., None])[..., 0]


def _ddp_loss(model, data, rows, agg, counts, dp_size):
    _, feats, tokens, old, ref, adv, mask = data
    logp = _token_logprobs(model, feats[rows], tokens[rows])
    pg, _ = policy_loss(logp, old[rows], adv[rows], mask[rows], clip_high=0.28, agg=agg,
                        dp_size=dp_size, **counts)
    kl = aggregate(kl_penalty(logp, ref[rows], "k3"), mask[rows], agg, dp_size=dp_size, **counts)
    return pg + 0.1 * kl


def _ddp_worker(rank, world, init_file, out_file):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    data = _ddp_problem()
    mask = data[-1]
    counts = dict(global_tokens=mask.sum(), global_seqs=(mask.sum(-1) > 0).sum())
    grads = {}
    for agg in AGG_MODES:
        model = DDP(_ddp_problem()[0])
        lo = rank * B // world
        mbs = [slice(lo, lo + 2), slice(lo + 2, lo + 4)]
        with model.no_sync():  # accumulate locally; the last backward all-reduces (averages)
            _ddp_loss(model, data, mbs[0], agg, counts, world).backward()
        _ddp_loss(model, data, mbs[1], agg, counts, world).backward()
        grads[agg] = [p.grad.clone() for p in model.parameters()]
    if rank == 0:
        torch.save(grads, out_file)
    # DDP's reducer keeps the gloo group alive through a reference cycle; left to interpreter
    # shutdown, a gloo worker thread needing the GIL is killed mid-C++ frame (SIGABRT, ~1 run in 4).
    del model
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def test_two_process_ddp_matches_full_batch(tmp_path):
    out = tmp_path / "grads.pt"
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, join=True)
    grads = torch.load(out)
    data = _ddp_problem()
    for agg in AGG_MODES:
        model = _ddp_problem()[0]
        _ddp_loss(model, data, slice(None), agg, {}, 1).backward()
        for p, g in zip(model.parameters(), grads[agg]):
            assert p.grad.abs().max() > 1e-3
            assert_close_to(g, p.grad, atol=1e-10)


def test_engine_mismatch_and_truncated_is_hand_values():
    from gearlab.core.grpo import engine_mismatch

    trainer = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    engine = torch.tensor([[-1.0, -1.0, -1.5, -9.0]])  # Δ = 0, −1, +1, (+6 but masked)
    mask = torch.tensor([[True, True, True, False]])
    w, m = engine_mismatch(trainer, engine, mask, "token_truncate", cap=2.0)
    assert m["engine_lp_diff_abs"].item() == pytest.approx(2 / 3)
    assert m["engine_lp_diff_max"].item() == pytest.approx(1.0)
    k3 = (0.0 + (math.exp(-1) - 1 + 1) + (math.e - 1 - 1)) / 3  # ρ − 1 − Δ per token
    assert m["engine_kl_k3"].item() == pytest.approx(k3)
    assert torch.allclose(w, torch.tensor([[1.0, math.exp(-1), 2.0, 0.0]]))  # e¹ capped at 2; masked token 0
    assert m["is_weight_mean"].item() == pytest.approx((1 + math.exp(-1) + 2) / 3)
    assert m["is_truncated_frac"].item() == pytest.approx(1 / 3) and m["is_masked_frac"].item() == 0
    w0, m0 = engine_mismatch(trainer, engine, mask, "none")
    assert w0 is None and "is_weight_mean" not in m0
    with pytest.raises(ValueError, match="engine_is mode"):
        engine_mismatch(trainer, engine, mask, "sequence")


E, E_1, E2 = math.e, math.exp(-1), math.exp(2)
# two rows: Δ = [0, −1, +1, (6, masked)] and [2, 2, (0), (0)]; token ratios ρ = [1, e⁻¹, e] and [e², e²];
# sequence ratios exp(mean Δ) = exp(0) = 1 and exp(2) = e² (the mean, not the sum: exp(4) would be e⁴)
IS_TRAINER = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.0, -1.0, -1.0, -1.0]])
IS_ENGINE = torch.tensor([[-1.0, -1.0, -1.5, -9.0], [-3.0, -3.0, -1.0, -1.0]])
IS_MASK = torch.tensor([[True, True, True, False], [True, True, False, False]])


@pytest.mark.parametrize("mode, weights, metrics", [
    ("token_truncate", [[1, E_1, 2, 0], [2, 2, 0, 0]],
     {"is_weight_mean": (1 + E_1 + 6) / 5, "is_truncated_frac": 3 / 5, "is_masked_frac": 0}),
    ("token_mask", [[1, E_1, 0, 0], [0, 0, 0, 0]],
     {"is_weight_mean": (1 + E_1) / 5, "is_truncated_frac": 0, "is_masked_frac": 3 / 5}),
    ("sequence_truncate", [[1, 1, 1, 0], [2, 2, 0, 0]],
     {"is_weight_mean": 7 / 5, "is_truncated_frac": 2 / 5, "is_masked_frac": 0, "is_seq_truncated_frac": 1 / 2,
      "is_seq_masked_frac": 0}),
    ("sequence_mask", [[1, 1, 1, 0], [0, 0, 0, 0]],
     {"is_weight_mean": 3 / 5, "is_truncated_frac": 0, "is_masked_frac": 2 / 5, "is_seq_truncated_frac": 0,
      "is_seq_masked_frac": 1 / 2}),
    ("icepop", [[1, 0, 0, 0], [0, 0, 0, 0]],  # e⁻¹ < 0.5 and e > 2 both leave; so do e², e²
     {"is_weight_mean": 1 / 5, "is_truncated_frac": 0, "is_masked_frac": 4 / 5}),
])
def test_engine_is_modes_hand_values(mode, weights, metrics):
    from gearlab.core.grpo import engine_mismatch

    w, m = engine_mismatch(IS_TRAINER, IS_ENGINE, IS_MASK, mode, cap=2.0, low=0.5)
    torch.testing.assert_close(w, torch.tensor(weights, dtype=torch.float32))
    for k, v in metrics.items():
        assert m[k].item() == pytest.approx(v), k
    assert not w.requires_grad


def test_sequence_ratio_is_the_geometric_mean_so_length_does_not_explode_it():
    """A sequence whose every token has ratio 1.01: the mean of log-ratios gives 1.01 at any length; the sum
    (TRL's bug #5815) would give 1.01^T, past any cap for long responses."""
    from gearlab.core.grpo import engine_mismatch

    T = 2000
    trainer, engine = torch.full((1, T), math.log(1.01)), torch.zeros(1, T)
    w, m = engine_mismatch(trainer, engine, torch.ones(1, T, dtype=torch.bool), "sequence_mask", cap=2.0)
    torch.testing.assert_close(w, torch.full((1, T), 1.01))
    assert m["is_seq_masked_frac"].item() == 0


def test_is_weights_scale_each_tokens_term_without_gradient():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.1, -0.4]])
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    w = torch.tensor([[0.5, 1.0, 2.0]], requires_grad=True)
    plain, _ = policy_loss(logp, old, adv, mask, agg="seq-mean-token-sum")
    weighted, _ = policy_loss(logp, old, adv, mask, agg="seq-mean-token-sum", is_weights=w)
    ratio = (logp - old).exp()
    per_tok = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    assert weighted.item() == pytest.approx((per_tok * w).sum().item())
    assert plain.item() == pytest.approx(per_tok.sum().item())
    weighted.backward()
    assert w.grad is None  # the weights are constants of the loss
    g = torch.autograd.grad(policy_loss(logp, old, adv, mask, agg="seq-mean-token-sum")[0], logp)[0]
    assert torch.allclose(logp.grad, g * w.detach())
