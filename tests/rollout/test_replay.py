"""Multi-turn episodes replayed and continued (gearlab.rollout.replay): a replay reaches the environment state the
episode had, a continuation given the episode's own seed reproduces it token for token, an environment that answers
otherwise is refused with one line, and Monte-Carlo values of multi-turn responses are the turns' values."""
from __future__ import annotations

import itertools

import pytest
import torch

from gearlab.envs.base import Environment, StepResult
from gearlab.rollout.base import SamplingParams
from gearlab.rollout.mc import mc_values, resampler_of_rows
from gearlab.rollout.multiturn import MultiTurnRolloutEngine
from gearlab.rollout.replay import EpisodeResampler, ReplayMismatch, episode_turns, replay
from gearlab.tasks.base import Problem
from gearlab.tasks.registry import get_task
from gearlab.tasks.tool_arith import ToolArithTask
from tests.rollout.scripted import ScriptedPolicy, demo_script

SP = SamplingParams(max_new_tokens=40, greedy=True)


@pytest.fixture
def task():
    return get_task("tool_arith")


def _env_state(env) -> tuple:
    return env.progress, env.calls, env.answer


def test_replay_reaches_the_state_the_episode_had_after_each_turn(tokenizer, task):
    """The scripted demonstration calls the tool with correct results (progress moves), then answers: replaying its
    first k turns gives the environment state of a fresh environment stepped by hand with the same k actions, and
    exactly the episode's tokens up to there."""
    problems = task.problems("train", 3, seed=0)
    policy = ScriptedPolicy(tokenizer, demo_script(tokenizer, task, problems))
    eng = MultiTurnRolloutEngine(tokenizer, task, max_turns=4)
    rb = eng.generate(policy, problems, group_size=1, sampling=SP, seed=0)
    rs = EpisodeResampler(eng, policy, problems, rb, SP)
    for n, p in enumerate(problems):
        acts = task.demo_actions(p)
        turns = episode_turns(rb.response_ids[n], rb.response_mask[n], rb.turn_ids[n], rb.attention_mask[n])
        assert len(turns) == len(acts) == 3 and rs.step_ends(n)[-1] == int(rb.response_mask[n].sum())
        recorded = rb.response_ids[n][rb.attention_mask[n]].tolist()
        for k in range(len(acts)):
            e = replay(eng, p, rs._prompts[n], turns, recorded, k, SP, 0)
            by_hand = task.make_env(p)
            by_hand.reset()
            for a in acts[:k]:
                by_hand.step(a)
            assert _env_state(e.env) == _env_state(by_hand)
            assert e.tokens == recorded[: len(e.tokens)] and len(e.turn_rewards) == k
        assert _env_state(e.env)[0] == k  # the calls before the answer were all correct


class CountingEnv(Environment):
    """Answers every action with its length and never ends the episode itself (the turn limit does): a random
    model's episodes then run every turn. Outcome: the total length of the actions is even."""

    def __init__(self, problem: Problem) -> None:
        self.problem, self.lengths = problem, []

    def reset(self) -> str:
        return self.problem.prompt

    def step(self, action: str) -> StepResult:
        self.lengths.append(len(action))
        return StepResult(f"length {len(action)}", 0.1 * (len(action) % 2), False, {"tool_call": True})

    def outcome(self) -> float:
        return float(sum(self.lengths) % 2 == 0)


class CountingTask(ToolArithTask):
    name = "counting"

    def make_env(self, problem: Problem) -> CountingEnv:
        return CountingEnv(problem)


@pytest.fixture
def counting():
    return CountingTask(max_turns=4)


@pytest.fixture
def eos_biased(tiny_model_factory, tokenizer):
    """The random tiny model with its end-of-turn logit raised: sampled turns end after a few tokens, so episodes
    run several turns (the environment answers its garbage actions)."""
    model = tiny_model_factory(0)
    eos = tokenizer.eos_token_id

    def hook(_m, _inp, out):
        out = out.clone()
        out[..., eos] += 6.0
        return out

    model.lm_head.register_forward_hook(hook)
    return model


def test_a_continuation_with_the_episodes_own_seed_reproduces_it_from_every_turn(tokenizer, counting, eos_biased):
    eng = MultiTurnRolloutEngine(tokenizer, counting, max_turns=4)
    sp = SamplingParams(max_new_tokens=16)
    problems = counting.problems("train", 8, seed=1)
    rb = eng.generate(eos_biased, problems, group_size=1, sampling=sp, seed=123)
    rs = EpisodeResampler(eng, eos_biased, problems, rb, sp)
    rows, cuts = [], []
    for n in range(len(problems)):
        for c in [0, *rs.step_ends(n)[:-1]]:
            rows.append(n)
            cuts.append(c)
    assert len(cuts) > 2 * len(problems)  # most episodes ran several turns
    own = torch.tensor([123 + n for n in rows])
    done = rs.continue_episodes(rows, cuts, own)
    for e, n in zip(done, rows):
        assert e.tokens == rb.response_ids[n][rb.attention_mask[n]].tolist()
        assert e.generated == rb.response_mask[n][rb.attention_mask[n]].tolist()
    r = rs.rewards(rows, cuts, own)
    assert torch.equal(r, rb.rewards[rows])
    other = rs.continue_episodes(rows, cuts, own + 10_000)
    differ = [a.tokens != b.tokens for a, b in zip(done, other)]
    assert sum(differ) > len(differ) // 2
    for e, n, c in zip(other, rows, cuts):  # the replayed prefix is kept; the budget holds
        recorded = rb.response_ids[n][rb.attention_mask[n]].tolist()
        kept = next(i for i in range(len(e.tokens) + 1) if sum(e.generated[:i]) == c and
                    (i == len(e.tokens) or e.generated[i]))  # the prefix: c generated tokens and what followed
        assert e.tokens[:kept] == recorded[:kept] and len(e.tokens) <= eng.episode_budget(sp)


def test_mc_values_of_a_multi_turn_batch_are_turn_values(tokenizer, counting, eos_biased):
    eng = MultiTurnRolloutEngine(tokenizer, counting, max_turns=4)
    sp = SamplingParams(max_new_tokens=16)
    problems = counting.problems("train", 4, seed=2)
    rb = eng.generate(eos_biased, problems, group_size=1, sampling=sp, seed=7)
    assert isinstance(resampler_of_rows(eng, eos_biased, rb, problems, sp), EpisodeResampler)
    values, cost = mc_values(eng, eos_biased, problems, rb, k=3, max_steps=8, sampling=sp, seed=0)
    for n, sv in enumerate(values):
        turns = episode_turns(rb.response_ids[n], rb.response_mask[n], rb.turn_ids[n], rb.attention_mask[n])
        assert sv.ends == list(itertools.accumulate(len(t) for t in turns))  # a step = a turn's generated tokens
        assert sv.values[-1] == float(rb.rewards[n])
    assert cost["continuations"] == 3 * sum(len(sv.ends) for sv in values)


def test_an_environment_that_answers_otherwise_cannot_be_replayed(tokenizer, task, monkeypatch):
    problems = task.problems("train", 1, seed=0)
    policy = ScriptedPolicy(tokenizer, demo_script(tokenizer, task, problems))
    eng = MultiTurnRolloutEngine(tokenizer, task, max_turns=4)
    counter = itertools.count()
    real_step = type(task.make_env(problems[0])).step

    def noisy_step(self, action):  # the tool's answer carries a call counter: not a function of the actions
        res = real_step(self, action)
        res.observation = f"{res.observation} #{next(counter)}"
        return res

    monkeypatch.setattr(type(task.make_env(problems[0])), "step", noisy_step)
    rb = eng.generate(policy, problems, group_size=1, sampling=SP, seed=0)
    rs = EpisodeResampler(eng, policy, problems, rb, SP)
    with pytest.raises(ReplayMismatch, match="task 'tool_arith': its environment answered a replayed action "
                                             "otherwise"):
        rs.rewards([0], [rs.step_ends(0)[0]], torch.tensor([0]))
