"""SDPO advantage blend (assigners/sdpo.py, docs/credit/sdpo.md): its gradient through gearlab's loss equals the
gradient of a transcription of TRL's ``SDPOTrainer`` loss blend (huggingface/trl@f2cd577, trl/experimental/sdpo:
``(1 − w)·policy_loss + w·distillation_loss``, loss_type "grpo", sampled-token distillation, on policy); the
teacher prompt carries a correct sibling in TRL's template; the contract kit."""
import pytest
import torch

from gearlab.core import grpo
from gearlab.core.batch import RolloutBatch
from gearlab.credit import Signal, build
from gearlab.credit.contract import assert_contract
from gearlab.rollout.base import SIBLING_TEMPLATE, sibling_demonstrations
from gearlab.rollout.hf import HFRolloutEngine
from gearlab.tasks.arithmetic import ArithmeticTask

from assigners.sdpo import has_sibling_demo


def trl_blend_loss(s, t, adv, mask, demo, w):
    """TRL's loss on policy: the GRPO term per sequence (token mean), then over the batch; the distillation term
    (s − t).detach()·s over the distillation tokens (response tokens of rows with a teacher context) per sequence,
    then a mean over every row; (1 − w)·policy + w·distillation."""
    m = mask.float()
    ratio = torch.exp(s - s.detach())
    pg_tok = -torch.min(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])
    pg = ((pg_tok * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    lm = m * demo[:, None].float()
    sd_tok = (s - t).detach() * s
    sd = ((sd_tok * lm).sum(-1) / lm.sum(-1).clamp(min=1)).mean()
    return (1 - w) * pg + w * sd


def _case(seed, B=8, T=10, G=4):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    rewards = (torch.rand(B, generator=g) < 0.4).float()
    rewards[:G] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # group 0: one correct row, which has no other correct sibling
    groups = torch.arange(B) // G
    s = -torch.rand(B, T, generator=g).mul(3) * mask
    t = -torch.rand(B, T, generator=g).mul(3) * mask
    batch = RolloutBatch(prompt_ids=torch.ones(B, 2, dtype=torch.long), prompt_mask=torch.ones(B, 2, dtype=torch.long),
                         response_ids=torch.randint(3, 9, (B, T), generator=g), response_mask=mask, group_ids=groups,
                         rewards=rewards)
    return batch, s, t, grpo.group_advantages(rewards, groups)


@pytest.mark.parametrize("lam", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gradient_equals_trls_loss_blend(seed, lam):
    batch, s, t, adv = _case(seed)
    demo = has_sibling_demo(batch.rewards, batch.group_ids)
    assert demo.tolist()[:4] == [False, True, True, True]
    a = build("sdpo", {"lam": lam})
    out = a.assign(batch, adv, {Signal.TEACHER_LOGPROBS: t, Signal.LOGPROBS: s})
    s1 = s.clone().requires_grad_(True)
    ours, _ = grpo.policy_loss(s1, s1.detach(), out.token_advantages, batch.response_mask, agg="seq-mean-token-mean")
    (g_ours,) = torch.autograd.grad(ours, s1)
    s2 = s.clone().requires_grad_(True)
    (g_trl,) = torch.autograd.grad(trl_blend_loss(s2, t, adv, batch.response_mask, demo, 1 - lam), s2)
    torch.testing.assert_close(g_ours, g_trl, rtol=1e-6, atol=1e-8)


def test_sibling_demonstrations_and_the_teacher_prompt(tokenizer):
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    groups = torch.arange(8) // 4
    assert sibling_demonstrations(rewards, groups) == [1, 2, 1, 1, 6, 6, None, 6]  # first correct other row, in order
    task = ArithmeticTask()
    engine = HFRolloutEngine(tokenizer, task)
    probs = task.problems("test", 2, seed=0)
    rows = [p for p in probs for _ in range(4)]
    texts = [f"response {i}" for i in range(8)]
    tids, tmask = engine.encode_sibling_prompts(rows, texts, rewards, groups)
    plain, pmask = engine.encode_prompts(rows)
    decoded = [tokenizer.decode(r[m.bool()]) for r, m in zip(tids, tmask)]
    for i, d in enumerate(sibling_demonstrations(rewards, groups)):
        if d is None:  # no correct sibling: the plain prompt
            assert tids[i][tmask[i].bool()].tolist() == plain[i][pmask[i].bool()].tolist()
        else:
            user = task.messages(rows[i])[-1]["content"]
            assert SIBLING_TEMPLATE.format(prompt=user, solution=texts[d]) in decoded[i]


def test_sdpo_passes_the_contract_kit_and_refuses_multi_turn_tasks():
    assert_contract("sdpo")
    assert_contract("sdpo", {"lam": 0.2, "teacher_mode": "live"})
    from gearlab.tasks.registry import get_task

    with pytest.raises(ValueError, match="single-turn"):
        build("sdpo").setup(seed=0, total_steps=1, task=get_task("tool_arith"))
