"""KTAE (assigners/ktae.py, docs/credit/ktae.md) against a reference written from the authors' code
(xiaolizh1/KTAE@ea9fb77: ``ComputeKeyTokens`` and ``compute_ktae_outcome_advantage_and_keytokens``), token by token
with the authors' structure (a count table per token id, the Fisher p-value by enumerating the hypergeometric
tables, information gain, Cohen's h plus the BM25 term-frequency contrast, float32), on random groups; its Fisher
test against scipy's; the contract kit."""
import math

import pytest
import torch
from scipy.stats import fisher_exact

from gearlab import credit
from gearlab.core.batch import RolloutBatch
from gearlab.credit.contract import assert_contract
from assigners.ktae import fisher_p


def _lc(n, k):
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def reference_key(ids, mask, rewards, zero_ids=(151643,)):
    """The authors' key-token weights for one group, transcribed: token id -> weight (float32 arithmetic)."""
    f32 = lambda v: float(torch.tensor(v, dtype=torch.float32))  # noqa: E731
    correct = [i for i in range(len(rewards)) if rewards[i] > 0]
    wrong = [i for i in range(len(rewards)) if rewards[i] <= 0]
    if not correct or not wrong:
        return {}
    toks = [[t for t, m in zip(ids[i], mask[i]) if m] for i in range(len(rewards))]
    tot_c, tot_w = sum(len(toks[i]) for i in correct), sum(len(toks[i]) for i in wrong)
    avg = (tot_c + tot_w) / 2
    out = {}
    for v in sorted({t for row in toks for t in row}):
        a = sum(v in toks[i] for i in correct)
        b = sum(v in toks[i] for i in wrong)
        c, d = len(correct) - a, len(wrong) - b
        n, r1, c1 = a + b + c + d, a + b, a + c
        # Fisher: probabilities of every table with these margins, in float32; keep those <= the observed one
        pk = lambda k: f32(math.exp(f32(f32(_lc(c1, k)) + f32(_lc(n - c1, r1 - k)) - f32(_lc(n, r1)))))  # noqa: E731
        p_obs = pk(a)
        p = sum(pk(k) for k in range(max(0, r1 + c1 - n), min(r1, c1) + 1) if pk(k) <= p_obs)
        F = math.exp(-2 * p) if f32(p) != 1.0 else 0.0
        H = lambda *q: -sum(x / sum(q) * math.log2(x / sum(q)) for x in q if x > 0) if sum(q) else 0.0  # noqa: E731
        ig = H(a + c, b + d) - ((a + b) / n * H(a, b) + (c + d) / n * H(c, d))
        h = math.asin(math.sqrt(a / (a + c + 1e-10))) - math.asin(math.sqrt(b / (b + d + 1e-10)))
        fc = sum(row.count(v) for i, row in enumerate(toks) if i in correct) / tot_c
        fw = sum(row.count(v) for i, row in enumerate(toks) if i in wrong) / tot_w
        tc = fc * 3 / (fc + 2 * (0.5 + 0.5 * tot_c / avg))
        tw = fw * 3 / (fw + 2 * (0.5 + 0.5 * tot_w / avg))
        x = h + tc / (tw + 1e-5) - tw / (tc + 1e-5)
        k = (F + ig) * x / 2
        sig = 1 / (1 + math.exp(-k)) if k >= 0 else math.exp(k) / (1 + math.exp(k))
        out[v] = 0.0 if v in zero_ids else (sig - 0.5) * 2
    return out


def _batch(seed, G=8, groups=3, T=12, vocab=20):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (G * groups, T), generator=g)
    lengths = torch.randint(3, T + 1, (G * groups,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    rewards = (torch.rand(G * groups, generator=g) < 0.4).float()
    rewards[:G] = 1.0  # group 0: all correct -> no key weights
    b = RolloutBatch.from_masks(mask, rewards=rewards, group_ids=torch.arange(groups).repeat_interleave(G))
    return b.with_(response_ids=ids)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_weights_equal_the_authors(seed):
    b = _batch(seed)
    a = torch.randn(b.batch_size)
    out = credit.build("ktae").assign(b, a, {})
    key = out.token_advantages - a[:, None] * b.response_mask
    assert (key[:8] == 0).all()  # the all-correct group
    checked = 0
    for g in (1, 2):
        rows = range(8 * g, 8 * g + 8)
        ref = reference_key([b.response_ids[i].tolist() for i in rows], [b.response_mask[i].tolist() for i in rows],
                            [float(b.rewards[i]) for i in rows])
        for i in rows:
            for t in range(b.response_ids.shape[1]):
                if b.response_mask[i, t]:
                    assert key[i, t].item() == pytest.approx(ref[int(b.response_ids[i, t])], abs=2e-6)
                    checked += 1
    assert checked > 50 and (key != 0).any()


def test_fisher_p_values_equal_scipys_two_sided_test():
    tables = torch.tensor([[3, 0, 1, 4], [2, 2, 2, 2], [5, 1, 0, 2], [0, 3, 4, 1], [1, 1, 6, 0]], dtype=torch.float64)
    ours = fisher_p(tables)
    for row, p in zip(tables.long().tolist(), ours.tolist()):
        a, b, c, d = row
        assert p == pytest.approx(fisher_exact([[a, c], [b, d]])[1], rel=1e-9)


def test_zero_ids_and_contract():
    b = _batch(3)
    zero = int(b.response_ids[8, 0])
    out = credit.build("ktae", {"zero_ids": [zero]}).assign(b, torch.zeros(b.batch_size), {})
    assert (out.token_advantages[8:][b.response_ids[8:] == zero] == 0).all()
    assert_contract("ktae")
