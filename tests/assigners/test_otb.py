"""OTB (assigners/otb.py, docs/credit/otb.md) against a transcription of verl's estimator
(verl-project/verl@018f23b5, ``compute_optimal_token_baseline_advantage``: token-level rewards on the last token,
the reversed-cumsum reward-to-go, the per-group loop), on ragged random groups with and without the zero-tail rule;
the ``sum_pi_squared`` signal against the full-vocabulary softmax of the model's own logits; the contract kit."""
from collections import defaultdict

import pytest
import torch

from gearlab import credit
from gearlab.core.batch import RolloutBatch
from gearlab.credit import Signal
from gearlab.credit.contract import assert_contract
from gearlab.signals.provider import SignalProvider


def reference_otb(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, handle_zero_tail=True,
                  epsilon=1e-8):
    """verl's single-turn estimator, transcribed (no rollout IS weights)."""
    with torch.no_grad():
        batch_size = token_level_rewards.shape[0]
        returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        w_per_timestep = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
        w_cumulative = (w_per_timestep * response_mask).cumsum(dim=-1)
        prompt_groups = defaultdict(list)
        for i in range(batch_size):
            prompt_groups[index[i]].append(i)
        baselines = torch.zeros_like(returns)
        for _, idx in prompt_groups.items():
            if len(idx) == 1:
                continue
            t = torch.tensor(idx)
            rg, wg, mg = returns[t], w_cumulative[t], response_mask[t]
            b = (rg * wg * mg).sum(dim=0) / ((wg * mg).sum(dim=0) + epsilon)
            baselines[t] = b.unsqueeze(0).expand(len(idx), -1)
            if handle_zero_tail:
                lengths = mg.sum(dim=-1)
                srt, _ = torch.sort(lengths)
                mx, second = int(srt[-1].item()), int(srt[-2].item())
                at = (lengths == mx).nonzero(as_tuple=True)[0]
                if at.numel() == 1 and mx > second:
                    baselines[idx[int(at[0])], second:] = 0.0
        return (returns - baselines) * response_mask


def _group_batch(seed, sizes=(4, 4, 1, 3), T=12):
    g = torch.Generator().manual_seed(seed)
    B = sum(sizes)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    lengths[:2] = T  # the first group: two longest responses of equal length (no zero tail)
    mask = torch.arange(T)[None] < lengths[:, None]
    groups = torch.cat([torch.full((n,), k) for k, n in enumerate(sizes)])
    rewards = (torch.rand(B, generator=g) < 0.5).float()
    rewards[-3:] = 1.0  # the last group: all correct (OTB leaves a residue there, GRPO does not)
    logits = torch.randn(B, T, 9, generator=g) * 2
    tok = torch.randint(0, 9, (B, T), generator=g)
    lp = torch.log_softmax(logits, -1).gather(-1, tok[..., None])[..., 0] * mask
    spsq = torch.softmax(logits, -1).square().sum(-1) * mask
    batch = RolloutBatch(prompt_ids=torch.ones(B, 2, dtype=torch.long), prompt_mask=torch.ones(B, 2, dtype=torch.long),
                         response_ids=tok + 3, response_mask=mask, group_ids=groups, rewards=rewards)
    return batch, lp, spsq


@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_otb_equals_verls_estimator(seed, zero_tail):
    batch, lp, spsq = _group_batch(seed)
    m = batch.response_mask.float()
    last = (m.cumsum(-1) == m.sum(-1, keepdim=True)) & batch.response_mask  # verl puts the score on the last token
    tlr = batch.rewards[:, None] * last.float()
    want = reference_otb(tlr, m, batch.group_ids.tolist(), lp, spsq, handle_zero_tail=zero_tail)
    a = credit.build("otb", {"handle_zero_tail": zero_tail})
    got = a.assign(batch, torch.zeros(batch.batch_size), {Signal.LOGPROBS: lp, "sum_pi_squared": spsq})
    torch.testing.assert_close(got.token_advantages, want, rtol=0, atol=1e-7)
    assert got.token_advantages[8].eq(batch.rewards[8] * m[8]).all()  # the one-response group: A = R
    if zero_tail:  # some group has a unique longest response whose tail advantage is its reward
        assert not torch.equal(want, reference_otb(tlr, m, batch.group_ids.tolist(), lp, spsq, handle_zero_tail=False))


def test_sum_pi_squared_is_the_collision_probability_of_the_models_logits(tiny_model_factory):
    model = tiny_model_factory(2)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(5, V, (3, 4), generator=g)
    pmask = torch.ones_like(prompt)
    prompt[2, :1], pmask[2, :1] = 0, 0
    resp = torch.randint(5, V, (3, 5), generator=g)
    rmask = torch.tensor([[1] * 5, [1] * 3 + [0] * 2, [1] * 5], dtype=torch.bool)
    b = RolloutBatch(prompt_ids=prompt, prompt_mask=pmask, response_ids=resp, response_mask=rmask,
                     group_ids=torch.zeros(3, dtype=torch.long), rewards=torch.tensor([1.0, 0.0, 1.0]))
    _, sig = SignalProvider(model, temperature=0.7, chunk_size=4, micro_batch_size=2).compute(
        b, {"sum_pi_squared"}, with_logprobs=False)
    s = sig["sum_pi_squared"]
    for i in range(3):
        ids = torch.cat([prompt[i][pmask[i].bool()], resp[i]])[None]
        with torch.no_grad():
            logits = model(ids).logits[0, int(pmask[i].sum()) - 1 : -1].float() / 0.7
        want = torch.softmax(logits, -1).square().sum(-1) * rmask[i]
        torch.testing.assert_close(s[i], want, rtol=1e-5, atol=1e-6)
    assert ((s > 0) & (s <= 1))[rmask].all() and (s[~rmask] == 0).all()


def test_otb_passes_the_contract_kit():
    assert_contract("otb")
    assert_contract("otb", {"handle_zero_tail": False})
