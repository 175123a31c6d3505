"""The multi-turn rollout loop on hand-made trajectories (a scripted policy, the real tokenizer and the
real tool task): token-in/token-out, turn ids, masks, per-turn rewards, budgets and end reasons."""
from __future__ import annotations

import math

import pytest
import torch

from gearlab import credit
from gearlab.rollout.multiturn import MultiTurnRolloutEngine, encode_demo, observation_text
from gearlab.rollout.base import SamplingParams
from gearlab.rollout.factory import make_engine
from gearlab.tasks.registry import get_task
from tests.rollout.scripted import ScriptedPolicy, action_ids, demo_script

SP = SamplingParams(max_new_tokens=40, greedy=True)


@pytest.fixture
def task():
    return get_task("tool_arith")


@pytest.fixture
def problems(task):
    return task.problems("train", 3, seed=0)


def _row(rb, i):
    n = int(rb.attention_mask[i].sum())
    return rb.response_ids[i, :n].tolist(), rb.response_mask[i, :n].tolist(), rb.turn_ids[i, :n].tolist()


def test_factory_picks_the_multi_turn_engine(tokenizer, task):
    assert isinstance(make_engine(tokenizer, task), MultiTurnRolloutEngine)
    assert make_engine(tokenizer, task).max_turns == task.max_turns == 4
    assert not isinstance(make_engine(tokenizer, get_task("arith")), MultiTurnRolloutEngine)


def test_perfect_episode_layout(tokenizer, task, problems):
    """Each turn: the policy's ids (mask 1) then the tool turn tokenised once (mask 0), one turn id."""
    p = problems[0]
    eng = MultiTurnRolloutEngine(tokenizer, task, max_turns=4)
    rb = eng.generate(ScriptedPolicy(tokenizer, demo_script(tokenizer, task, problems)), [p], group_size=1,
                      sampling=SP, seed=0)
    acts = task.demo_actions(p)
    env = task.make_env(p)
    env.reset()
    exp_ids, exp_gen, exp_tid, exp_r = [], [], [], []
    for k, a in enumerate(acts):
        ids = action_ids(tokenizer, a)
        exp_ids += ids
        exp_gen += [True] * len(ids)
        exp_tid += [k] * len(ids)
        res = env.step(a)
        exp_r.append(res.reward)
        if not res.done:
            obs = tokenizer(observation_text(res.observation), add_special_tokens=False)["input_ids"]
            exp_ids += obs
            exp_gen += [False] * len(obs)
            exp_tid += [k] * len(obs)
    ids, gen, tid = _row(rb, 0)
    assert (ids, gen, tid) == (exp_ids, exp_gen, exp_tid)
    assert rb.turn_rewards[0].tolist() == pytest.approx(exp_r) and exp_r == pytest.approx([0.3, 0.3, 0.0])
    assert rb.rewards.tolist() == [1.0]
    assert rb.meta["end_reasons"] == ["done"]
    assert rb.meta["anchor_obs"][0][0] == p.prompt and len(rb.meta["anchor_obs"][0]) == 3
    st = rb.meta["rollout_stats"]
    assert st["tool_call_frac"] == 1.0 and st["finish_frac"] == 1.0 and st["correct_call_frac"] == 1.0
    # the warm start's layout of the same demonstration is token-for-token the rollout's
    demo_ids, labels = encode_demo(tokenizer, task, p, acts)
    P = int(rb.prompt_mask[0].sum())
    assert demo_ids == rb.prompt_ids[0, -P:].tolist() + exp_ids
    assert labels == [False] * P + exp_gen


def test_sampled_ids_kept_exactly(tokenizer, task, problems):
    """A non-canonical spelling (one token per byte) survives: no decode → re-encode round trip."""
    p = problems[0]
    odd = [tokenizer.convert_tokens_to_ids(c) for c in "Answer:"] + \
        tokenizer(" " + p.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert odd[:-1] != tokenizer("Answer: " + p.answer, add_special_tokens=False)["input_ids"]
    rb = MultiTurnRolloutEngine(tokenizer, task).generate(ScriptedPolicy(tokenizer, lambda t, k: odd), [p],
                                                          group_size=1, sampling=SP, seed=0)
    assert _row(rb, 0)[0] == odd
    assert rb.rewards.tolist() == [1.0]  # answered without a tool: the outcome does not require one
    assert rb.meta["rollout_stats"]["tool_call_frac"] == 0.0


def test_token_budget_cuts_mid_turn(tokenizer, task, problems):
    """The second call does not fit: that turn is kept (mask 1), never stepped, turn reward 0."""
    p = problems[0]
    pol = ScriptedPolicy(tokenizer, demo_script(tokenizer, task, problems))
    first = action_ids(tokenizer, task.demo_actions(p)[0])
    env = task.make_env(p)
    env.reset()
    obs = tokenizer(
        observation_text(env.step(task.demo_actions(p)[0]).observation), add_special_tokens=False
    )["input_ids"]
    budget = len(first) + len(obs) + 5
    rb = MultiTurnRolloutEngine(tokenizer, task, max_total_tokens=budget).generate(
        pol, [p], group_size=1, sampling=SP, seed=0
    )
    ids, gen, tid = _row(rb, 0)
    assert len(ids) == budget
    assert gen == [True] * len(first) + [False] * len(obs) + [True] * 5
    assert tid == [0] * (len(first) + len(obs)) + [1] * 5
    assert ids[-5:] == action_ids(tokenizer, task.demo_actions(p)[1])[:5]
    assert rb.turn_rewards[0].tolist() == pytest.approx([0.3, 0.0])  # turn 1 happened, earned nothing
    assert rb.meta["end_reasons"] == ["token_budget"] and rb.rewards.tolist() == [0.0]


def test_turn_length_and_max_turns(tokenizer, task, problems):
    p = problems[0]
    pol = ScriptedPolicy(tokenizer, demo_script(tokenizer, task, problems))
    rb = MultiTurnRolloutEngine(tokenizer, task).generate(pol, [p], group_size=1, seed=0,
                                                          sampling=SamplingParams(max_new_tokens=6, greedy=True))
    assert rb.meta["end_reasons"] == ["turn_length"] and int(rb.response_mask.sum()) == 6
    assert rb.turn_rewards.tolist() == [[0.0]]
    # a policy that calls forever: stops at the turn limit; the last tool answer is not appended
    loop = action_ids(tokenizer, "<call>calc 1+1</call>")
    rb = MultiTurnRolloutEngine(tokenizer, task, max_turns=3).generate(ScriptedPolicy(tokenizer, lambda t, k: loop),
                                                                       [p],
                                                                       group_size=1, sampling=SP, seed=0)
    ids, gen, tid = _row(rb, 0)
    assert rb.meta["end_reasons"] == ["max_turns"] and gen[-1] and ids[-len(loop):] == loop
    assert sorted(set(tid)) == [0, 1, 2]
    assert rb.turn_rewards[0].tolist() == pytest.approx([0.1, 0.1, 0.0])  # valid calls beyond num_steps earn nothing


def test_batched_episodes_end_independently(tokenizer, task, problems):
    """Rows that end at different turns: NaN pads the turns that did not happen; every row equals the
    same episode rolled out alone; finished rows are not generated for again."""
    def script(text: str, turn: int) -> list[int]:
        if problems[1].prompt in text:
            return action_ids(tokenizer, "no idea")  # ends at turn 0, no call, no answer
        return demo_script(tokenizer, task, problems)(text, turn)

    pol = ScriptedPolicy(tokenizer, script)
    eng = MultiTurnRolloutEngine(tokenizer, task)
    rb = eng.generate(pol, problems, group_size=2, sampling=SP, seed=0)
    assert pol.calls == [6, 4, 4]
    assert rb.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert math.isnan(rb.turn_rewards[2, 1]) and rb.turn_rewards[2, 0] == 0.0
    assert rb.rewards.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert rb.meta["end_reasons"] == ["done"] * 6
    assert rb.meta["rollout_stats"]["finish_frac"] == pytest.approx(4 / 6)
    alone = eng.generate(ScriptedPolicy(tokenizer, script), [problems[2]], group_size=1, sampling=SP, seed=0)
    assert _row(rb, 4) == _row(alone, 0)
    # padding: attention 0, generated 0, turn id 0
    pad = ~rb.attention_mask
    assert not rb.response_mask[pad].any() and (rb.turn_ids[pad] == 0).all()


def test_env_error_is_counted_not_fatal(tokenizer, task, problems, monkeypatch):
    from gearlab.tasks.tool_arith import ToolArithEnv

    def boom(self, action):
        raise RuntimeError("env crashed")

    monkeypatch.setattr(ToolArithEnv, "step", boom)
    pol = ScriptedPolicy(tokenizer, demo_script(tokenizer, task, problems))
    rb = MultiTurnRolloutEngine(tokenizer, task).generate(pol, problems[:1], group_size=2, sampling=SP, seed=0)
    assert rb.meta["end_reasons"] == ["env_error"] * 2 and rb.meta["reward_errors"] == 2
    with pytest.raises(RuntimeError, match="env crashed"):
        MultiTurnRolloutEngine(tokenizer, task, reward_errors="raise").generate(pol, problems[:1], group_size=1,
                                                                               sampling=SP, seed=0)


def test_turn_assigners_on_a_real_multi_turn_batch(tokenizer, task, problems):
    """mt_grpo / gigpo / gear accept the loop's batch; turn credit lands on generated tokens only and
    GEAR's segments never cross a turn boundary."""
    from gearlab.credit import Signal
    from gearlab.core.grpo import group_advantages

    n = [0]

    def script(text: str, turn: int) -> list[int]:
        # group members differ: every other episode answers at once without tools (a wrong number)
        n[0] += 1
        if turn == 0 and n[0] % 2:
            return action_ids(tokenizer, "Answer: 0")
        return demo_script(tokenizer, task, problems)(text, turn)

    rb = MultiTurnRolloutEngine(tokenizer, task).generate(ScriptedPolicy(tokenizer, script), problems, group_size=2,
                                                          sampling=SP, seed=0)
    seq = group_advantages(rb.rewards, rb.group_ids)
    B, T = rb.response_ids.shape
    g = torch.Generator().manual_seed(0)
    sig = {s: torch.rand(B, T, generator=g) for s in Signal}
    for name in ("mt_grpo", "gigpo", "gear"):
        a = credit.build(name)
        a.setup(seed=0, total_steps=1, task=task)
        adv = a.assign(rb, seq, {s: sig[s] for s in a.needs}).token_advantages
        assert adv.shape == (B, T) and torch.isfinite(adv).all()
        assert (adv[~rb.response_mask] == 0).all(), name
        segs = getattr(a, "last_segments", None)
        if segs is not None:  # [B, T] segment index, -1 outside: one turn per segment, generated tokens only
            assert (segs >= 0).any()
            for i in range(B):
                for j in segs[i].unique().tolist():
                    if j >= 0:
                        inside = segs[i] == j
                        assert rb.response_mask[i][inside].all() and rb.turn_ids[i][inside].unique().numel() == 1
