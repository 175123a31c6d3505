"""The GRPO module's in-forward credit: a method that needs only the policy's entropy and can be assigned micro-batch
by micro-batch takes the entropy from the update's own forward — no separate pass, the same advantages and the same
parameters after the step as with the separate pass (on-policy, where both forwards see the same weights)."""
from __future__ import annotations

import mlflow
import pytest
import torch

from gearlab import credit
from gearlab.config import load_config
from gearlab.signals.provider import SignalProvider
from gearlab.trainer.train import train


@pytest.fixture(scope="module")
def graded_task():
    """Arithmetic prompts with a reward graded by the share of digits in the completion: a random model's groups
    have spread, so the advantages (and the update) are not zero."""
    from gearlab.tasks.arithmetic import ArithmeticTask
    from gearlab.tasks.registry import register_task

    @register_task("digit_share_for_tests")
    class DigitShare(ArithmeticTask):
        def reward(self, problem, completion):
            return sum(c.isdigit() for c in completion) / max(1, len(completion))

    return "digit_share_for_tests"


def _run(tmp_path, model_dir, mode, *extra):
    cfg = load_config([f"model.name_or_path={model_dir}", f"trainer.output_dir={tmp_path / mode}",
                       "trainer.max_steps=2",
                       "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=12",
                       "algorithm.micro_batch_size=4", "trainer.progress_bar=false", "optim.lr=1e-3",
                       "eval.num_problems=4", f"signals.entropy_in_forward={mode}", "task.name=digit_share_for_tests",
                       *extra])
    res = train(cfg)
    from transformers import AutoModelForCausalLM

    params = AutoModelForCausalLM.from_pretrained(res.run_dir / "final").state_dict()
    return params, mlflow.MlflowClient(res.tracking_uri).get_run(res.mlflow_run_id).data.metrics


@pytest.mark.parametrize("assigner", [
    ["assigner=entropy_adv"],
    ["assigner=entropy_fork", "assigner.options.scope=micro_batch", "assigner.options.micro_batch_size=4",
     "assigner.options.normaliser=trl"],
])
def test_entropy_from_the_update_forward_equals_the_separate_pass(
    tmp_path, tiny_model_dir, monkeypatch, graded_task, assigner
):
    passes = []
    real = SignalProvider.compute
    monkeypatch.setattr(SignalProvider, "compute", lambda self, *a, **k: passes.append(1) or real(self, *a, **k))
    p_in, m_in = _run(tmp_path, tiny_model_dir, "true", *assigner)
    assert not passes and m_in["signals/entropy_in_forward"] == 1.0  # no separate forward ran
    p_off, m_off = _run(tmp_path, tiny_model_dir, "false", *assigner)
    assert len(passes) == 2 and "signals/entropy_in_forward" not in m_off
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    moved = 0
    for k in p_in:
        assert torch.allclose(p_in[k], p_off[k], atol=1e-5), k
        moved += not torch.equal(p_in[k], initial[k])
    assert moved  # the steps did change the weights
    for k in ("credit/adv_mean", "credit/adv_abs_mean", "credit/adv_std", "train/reward"):
        assert m_in[k] == pytest.approx(m_off[k], abs=1e-5), k
    assert m_in["credit/adv_abs_mean"] > 0


def test_which_methods_may_assign_inside_the_update():
    assert credit.build("entropy_adv", {}).chunk_local(8)
    fork = dict(scope="micro_batch", micro_batch_size=4, normaliser="trl")
    assert credit.build("entropy_fork", fork).chunk_local(8) and not credit.build("entropy_fork", fork).chunk_local(6)
    assert not credit.build("entropy_fork", {**fork, "normaliser": "paper"}).chunk_local(8)  # its loss mask
    assert not credit.build("entropy_fork", {}).chunk_local(8)  # batch scope
    assert not credit.build("grpo", {}).chunk_local(8)


def test_no_signal_streak_counts_resets_and_says_what_to_check(caplog):
    """The per-iteration warning, the louder one every ``trainer.no_signal_patience`` iterations in a row, the reset
    when a group's rewards differ, and the reason the louder one gives (all solved / mixed / a method's own credit)."""
    import logging
    from types import SimpleNamespace

    from gearlab.core import grpo
    from gearlab.trainer.module import GRPOModule

    cfg = load_config(["rollout.group_size=2", "trainer.max_steps=6", "trainer.no_signal_patience=2"])
    module = SimpleNamespace(cfg=cfg, _trainer=None, no_signal_streak=0, totals={"no_signal_iterations": 0},
                             iterations_done=0, _global_sum=lambda x: torch.as_tensor(x, dtype=torch.float32))
    groups = torch.tensor([0, 0, 1, 1])
    batches = [([1.0, 1.0, 0.0, 0.0], {}), ([1.0, 1.0, 0.0, 0.0], {}), ([1.0, 0.0, 0.0, 0.0], {}),
               ([1.0, 1.0, 1.0, 1.0], {}), ([1.0, 1.0, 1.0, 1.0], {"adv_abs_mean": 0.2})]
    caplog.set_level(logging.WARNING, logger="gearlab")
    streaks = []
    for rewards, credit_metrics in batches:
        module.iterations_done += 1
        rb = SimpleNamespace(rewards=torch.tensor(rewards), group_ids=groups)
        GRPOModule._check_signal(
            module, rb, rb.rewards, grpo.zero_std_fraction(rb.rewards, groups), sum(rewards) / 4, credit_metrics
        )
        streaks.append(module.no_signal_streak)
    assert streaks == [1, 2, 0, 1, 2] and module.totals["no_signal_iterations"] == 4
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "gearlab"]
    assert said == [
        (logging.WARNING, "iteration 1/6: no learning signal: every group's 2 samples got equal rewards (mean reward "
                          "0.500), so every GRPO advantage is 0"),
        (logging.WARNING, "iteration 2/6: no learning signal: every group's 2 samples got equal rewards (mean reward "
                          "0.500), so every GRPO advantage is 0"),
        (logging.ERROR, "NO LEARNING SIGNAL for 2 iterations in a row (2 of 2 so far): the run is training on "
                        "nothing — "
                        "each problem is either always or never solved: use problems of mixed difficulty or a larger "
                        "rollout.group_size (trainer.no_signal_patience=2)"),
        (logging.WARNING, "iteration 4/6: no learning signal: every group's 2 samples got equal rewards (mean reward "
                          "1.000), so every GRPO advantage is 0"),
        (logging.WARNING, "iteration 5/6: no learning signal: every group's 2 samples got equal rewards (mean reward "
                          "1.000), so every GRPO advantage is 0 (the credit method's own non-outcome credit still "
                          "moved "
                          "the policy)"),
        (logging.ERROR, "NO LEARNING SIGNAL for 2 iterations in a row (4 of 5 so far): the rewards teach the policy "
                        "nothing (only the credit method's own non-outcome credit moves it) — every sample earned full "
                        "reward: the problems are too easy for this model "
                        "(trainer.no_signal_patience=2)"),
    ]


def test_logged_loss_terms_are_the_whole_batchs_at_any_micro_batch_size(tmp_path, tiny_model_dir, graded_task):
    """update/pg_loss, kl and entropy_bonus are the loss terms of the whole update, whatever the number of micro-batches
    it is cut into (a mean of per-micro-batch partial sums would log 1/4 of them with 4 micro-batches)."""
    logged = {}
    for mbs in (16, 4):  # 4 prompts × 4: one micro-batch, then four; the 2nd iteration's KL to the start is not 0
        cfg = load_config([f"model.name_or_path={tiny_model_dir}", f"trainer.output_dir={tmp_path / str(mbs)}",
                           "trainer.max_steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4",
                           "rollout.max_new_tokens=12", f"algorithm.micro_batch_size={mbs}", "algorithm.kl_coef=0.1",
                           "algorithm.entropy_coef=0.01", "trainer.progress_bar=false", "optim.lr=1e-3",
                           "eval.num_problems=0", "task.name=digit_share_for_tests"])
        res = train(cfg)
        logged[mbs] = mlflow.MlflowClient(res.tracking_uri).get_run(res.mlflow_run_id).data.metrics
    for k in ("update/pg_loss", "update/kl", "update/entropy_bonus"):
        assert logged[16][k] != 0, k
        assert logged[4][k] == pytest.approx(logged[16][k], rel=1e-4, abs=1e-7), k


@pytest.mark.parametrize("mode", ["false", "true"])  # credit from a separate pass / inside the update (hook)
def test_cropped_micro_batches_train_as_the_padded_ones(tmp_path, tiny_model_dir, graded_task, mode):
    """algorithm.crop_padding: micro-batches of 2 at their own widths end two iterations at the weights of the
    padded ones (float rounding apart) with the same logged loss."""
    extra = ("assigner=entropy_adv", "algorithm.micro_batch_size=2")
    p_on, m_on = _run(tmp_path / "on", tiny_model_dir, mode, *extra, "algorithm.crop_padding=true")
    p_off, m_off = _run(tmp_path / "off", tiny_model_dir, mode, *extra, "algorithm.crop_padding=false")
    assert max((p_on[k] - p_off[k]).abs().max().item() for k in p_on) < 1e-5
    assert abs(m_on["update/pg_loss"] - m_off["update/pg_loss"]) < 1e-6
    assert m_on["train/reward"] == m_off["train/reward"]  # the same rollouts


def test_passes_that_backpropagate_run_without_cudnn_attention(tmp_path, tiny_model_dir, monkeypatch, graded_task):
    """cuDNN's SDPA backward returns NaN gradients on some masked inputs (gearlab.core.sdpa): every attention call
    that builds a graph (the update's forward, OAR-G's input-gradient pass) must run with that backend off, and the
    flags must come back for the forward-only passes (rollouts keep every backend)."""
    import torch.nn.functional as F

    seen: list[tuple[bool, bool]] = []  # (grad enabled, cuDNN SDPA enabled) at each attention call
    real = F.scaled_dot_product_attention

    def spy(*a, **k):
        seen.append((torch.is_grad_enabled(), torch.backends.cuda.cudnn_sdp_enabled()))
        return real(*a, **k)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    _run(tmp_path, tiny_model_dir, "false", "assigner=oar_g", "trainer.max_steps=1")
    with_grad = [cudnn for grad, cudnn in seen if grad]
    without = [cudnn for grad, cudnn in seen if not grad]
    assert with_grad and not any(with_grad)  # every differentiated attention call: cuDNN off
    assert without and any(without)  # the rollout's forward-only calls: cuDNN still allowed
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored


def test_the_rollout_fingerprint_sees_tokens_not_padding_or_row_order():
    """train/rollout_crc: the same responses padded to another width, or in another row order, give the same value
    (the split of rows over ranks and each rank's padding must not change it); one token changed changes it."""
    from types import SimpleNamespace

    from gearlab.trainer.module import GRPOModule

    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    mask = ids != 0
    crc = lambda i, m: GRPOModule._rollout_crc(SimpleNamespace(device="cpu"), SimpleNamespace(  # noqa: E731
        response_ids=i, attention_mask=m))
    base = crc(ids, mask)
    wider = torch.cat([ids, torch.zeros(2, 3, dtype=torch.long)], 1)
    assert crc(wider, wider != 0) == base
    assert crc(ids.flip(0), mask.flip(0)) == base
    other = ids.clone()
    other[1, 1] = 10
    assert crc(other, mask) != base
    assert 0 <= base < 1_000_000 and base == float(int(base))
