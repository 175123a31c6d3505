"""Multi-turn rollouts, token-in/token-out, many environments at once.

Per turn, every unfinished episode's context (its prompt ids ⊕ everything appended so far) is
left-padded into one batch and the policy samples until its end-of-turn token. The sampled ids are
appended EXACTLY as generated (``response_mask = 1``); the decoded text (without the end-of-turn
token) is the action given to ``env.step``; the environment's answer is wrapped as a chat turn,
tokenised ONCE and appended (``response_mask = 0``). Nothing is ever decoded and re-encoded, so the
tokens trained on are the tokens sampled (no retokenisation drift: docs/credit/README.md#multi-turn-data).

Every token carries its turn id (turn k = generation k + the environment text after it, the
convention of ``assigners/mt_grpo.py``). ``turn_rewards[i, k]`` is the intermediate reward of turn k;
NaN pads turns that did not happen. ``rewards[i]`` is ``env.outcome()``.

An episode ends for one of these reasons (``meta["end_reasons"]``):
  ``done``          the environment ended it (final answer, or an action it cannot continue from)
  ``max_turns``     the turn limit was reached
  ``token_budget``  the response (policy + environment tokens) would exceed ``max_total_tokens``:
                    either the policy's turn was cut mid-turn (that turn is never stepped and earns
                    turn reward 0) or the next observation did not fit (it is not appended)
  ``turn_length``   one turn hit ``max_new_tokens`` without its end-of-turn token (not stepped)
  ``env_error``     ``env.step`` raised (counted in ``reward_errors``; outcome still asked)
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Hashable, Sequence

import torch
from torch import Tensor, nn

from gearlab.core.batch import RolloutBatch
from gearlab.envs.base import Environment, StepResult
from gearlab.parallel.distributed import global_max_int
from gearlab.rollout.hf import HFRolloutEngine
from gearlab.rollout.base import SamplingParams, left_pad, row_seeds
from gearlab.tasks.base import Problem, Task

__all__ = ["observation_text", "Episode", "MultiTurnRolloutEngine", "END_REASONS", "encode_demo"]

END_REASONS = ("done", "max_turns", "token_budget", "turn_length", "env_error")


def observation_text(observation: str) -> str:
    """The environment's answer as a ChatML tool turn, closing the policy's turn and opening its next
    one. The policy's turn ended with ``<|im_end|>``; what follows it in a ChatML conversation is
    exactly this text."""
    return f"\n<|im_start|>tool\n{observation}<|im_end|>\n<|im_start|>assistant\n"


@dataclass
class Episode:
    """One trajectory being rolled out (a row of the final batch)."""

    problem: Problem
    env: Environment
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    generated: list[bool] = field(default_factory=list)
    turn_of: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the engine's, for generated tokens (0 elsewhere)
    turn_rewards: list[float] = field(default_factory=list)
    anchors: list[Hashable] = field(default_factory=list)
    end_reason: str | None = None
    calls: int = 0
    valid_calls: int = 0
    correct_calls: int = 0
    finished: bool = False
    env_errors: int = 0
    index: int = 0  # its row in the rollout call: its sampling seed is the call's seed + index

    def append(self, ids: Sequence[int], generated: bool, turn: int, logprobs: Sequence[float] | None = None) -> None:
        self.tokens += list(ids)
        self.generated += [generated] * len(ids)
        self.turn_of += [turn] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)


def encode_demo(tokenizer, task: Task, problem: Problem, actions: Sequence[str], privileged: bool | str = False
                ) -> tuple[list[int], list[bool]]:
    """Token ids and label mask of a demonstrated episode, laid out exactly as a rollout would lay it
    out: chat prompt, then per turn the action tokens + end-of-turn (labels on) and the environment's
    REAL answer to that action (labels off). Used by the warm start. Returns (ids, is_label)."""
    env = task.make_env(problem)
    env.reset()
    ids = list(_prompt_ids(tokenizer, task, problem, privileged))
    labels = [False] * len(ids)
    for k, action in enumerate(actions):
        a = tokenizer(action, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids += a
        labels += [True] * len(a)
        res = env.step(action)
        if res.done or k == len(actions) - 1:
            break
        o = tokenizer(observation_text(res.observation), add_special_tokens=False)["input_ids"]
        ids += o
        labels += [False] * len(o)
    return ids, labels


def _prompt_ids(tokenizer, task: Task, problem: Problem, privileged: bool | str = False) -> list[int]:
    msgs = task.messages(problem, privileged=privileged)
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class MultiTurnRolloutEngine(HFRolloutEngine):
    """Batched multi-turn rollouts of a task with ``multi_turn = True`` (it provides ``make_env``).

    max_turns:        policy turns per episode at most
    max_total_tokens: response tokens (policy + environment) per episode at most; 0 = max_new_tokens ×
                      max_turns. ``SamplingParams.max_new_tokens`` caps ONE turn.
    step_workers:     threads stepping environments in parallel (tool calls that start processes)
    """

    def __init__(self, tokenizer, task: Task, *, batch_size: int = 64, reward_errors: str = "zero",
                 max_turns: int = 4, max_total_tokens: int = 0, step_workers: int = 8, generator=None,
                 static_cache: bool = False) -> None:
        super().__init__(tokenizer, task, batch_size=batch_size, reward_errors=reward_errors, generator=generator,
                         static_cache=static_cache)
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.step_workers = step_workers

    def encode_prompts(self, problems: Sequence[Problem], *, privileged: bool | str = False) -> tuple[Tensor, Tensor]:
        return left_pad([_prompt_ids(self.tok, self.task, p, privileged) for p in problems], self.tok.pad_token_id)

    def _step(self, ep: Episode, action: str) -> StepResult | None:
        try:
            return ep.env.step(action)
        except Exception:
            if self.reward_errors == "raise":
                raise
            return None

    def episode_budget(self, sampling: SamplingParams) -> int:
        """Response tokens (policy + environment) one episode may hold: ``max_total_tokens``, else turns × turn cap."""
        return self.max_total_tokens or sampling.max_new_tokens * self.max_turns

    def new_episode(self, problem: Problem, index: int, privileged: bool | str = False,
                    prompt: list[int] | None = None) -> Episode:
        """A fresh episode of ``problem``: its environment reset, nothing generated yet (``prompt``: its prompt ids
        when already known, else encoded here)."""
        env = self.task.make_env(problem)
        obs0 = env.reset()
        ids = list(prompt) if prompt is not None else _prompt_ids(self.tok, self.task, problem, privileged)
        return Episode(problem, env, ids, anchors=[obs0], index=index)

    @torch.no_grad()
    def rollout(self, model: nn.Module, problems: Sequence[Problem], sampling: SamplingParams, seed: int | Tensor,
                privileged: bool | str = False, start: Sequence[Episode] | None = None) -> list[Episode]:
        """Run one episode per problem (repeat a problem for a group); returns the finished episodes.
        ``privileged``: the policy itself sees the privileged prompt (to evaluate the teacher's context).
        ``start``: go on with these episodes instead (their turns so far replayed, ``gearlab.rollout.replay``;
        ``problems`` is then ignored): each continues at its own next turn, with that turn's seed."""
        budget = self.episode_budget(sampling)
        stop = set(self._stop_ids())
        episodes = list(start) if start is not None else [self.new_episode(p, i, privileged)
                                                            for i, p in enumerate(problems)]
        base_seeds = row_seeds(seed, len(episodes))  # episode i: seed + i, or the i-th of the seeds given
        pool = ThreadPoolExecutor(self.step_workers) if self.step_workers > 1 else None
        try:
            device = next(model.parameters()).device
            for _ in range(self.max_turns):  # each active episode takes its own next turn (all equal unless ``start``)
                active = [e for e in episodes if e.end_reason is None and len(e.turn_rewards) < self.max_turns]
                n_active = global_max_int(len(active), device) if self.synced_gpus else len(active)
                if not n_active:  # (sharded: no rank has an active episode left)
                    break
                if not active:  # this rank is done but others generate: take part in their collectives
                    self.sample_with_logprobs(model, torch.zeros((0, 1), dtype=torch.long), torch.zeros((0, 1),
                                              dtype=torch.long),
                                              sampling, seed)
                    continue
                caps = [min(sampling.max_new_tokens, budget - len(e.tokens)) for e in active]
                ids, mask = left_pad([e.prompt + e.tokens for e in active], self.tok.pad_token_id)
                # each episode's own seed per turn (its index in the call: the trainer folds the rank's first
                # global row into ``seed``), whichever episodes are still active beside it
                turns = torch.tensor([len(e.turn_rewards) for e in active], dtype=torch.long)
                turn_seeds = (base_seeds[[e.index for e in active]] + 1_000_003 * (turns + 1)) % (2**63 - 1)
                resp, rmask, lps = self.sample_with_logprobs(model, ids, mask, replace(sampling,
                                                             max_new_tokens=max(caps)),
                                                             turn_seeds)
                acting: list[tuple[Episode, str]] = []
                for k, (e, cap, row, m) in enumerate(zip(active, caps, resp, rmask)):
                    toks = row[: int(m.sum())].tolist()[:cap]
                    e.append(toks, True, len(e.turn_rewards), None if lps is None else lps[k, : len(toks)].tolist())
                    e.turn_rewards.append(0.0)
                    if not toks or toks[-1] not in stop:  # cut mid-turn: never stepped
                        e.end_reason = "token_budget" if cap < sampling.max_new_tokens else "turn_length"
                        continue
                    acting.append((e, self.tok.decode(toks[:-1], skip_special_tokens=True)))
                results = list(pool.map(lambda a: self._step(*a), acting)) if pool else [self._step(*a) for a in acting]
                for (e, _), res in zip(acting, results):
                    self._apply(e, res, len(e.turn_rewards) - 1, budget)
        finally:
            if pool:
                pool.shutdown()
        return episodes

    def _apply(self, e: Episode, res: StepResult | None, turn: int, budget: int) -> None:
        if res is None:
            e.env_errors += 1
            e.end_reason = "env_error"
            return
        r = float(res.reward)
        if not math.isfinite(r):
            if self.reward_errors == "raise":
                raise ValueError(f"environment returned a non-finite turn reward {r}")
            r, e.env_errors = 0.0, e.env_errors + 1
        e.turn_rewards[-1] = r
        info = res.info or {}
        e.calls += bool(info.get("tool_call"))
        e.valid_calls += bool(info.get("valid_call"))
        e.correct_calls += bool(info.get("correct"))
        e.finished = e.finished or bool(info.get("finished"))
        if res.done:
            e.end_reason = "done"
            return
        if turn == self.max_turns - 1:
            e.end_reason = "max_turns"  # the observation would never be read: not appended
            return
        obs = self.tok(observation_text(res.observation), add_special_tokens=False)["input_ids"]
        if len(e.tokens) + len(obs) >= budget:  # no room for the observation plus one policy token
            e.end_reason = "token_budget"
            return
        e.append(obs, False, turn)
        e.anchors.append(info.get("anchor", res.observation))

    def generate(self, model: nn.Module, problems: Sequence[Problem], *, group_size: int, sampling: SamplingParams,
                 seed: int | Tensor, with_teacher: bool | str = False, group_offset: int = 0,
                 privileged: bool | str = False) -> RolloutBatch:
        """``group_size`` episodes per problem; row i·G+j is episode j of problem i (as the single-turn engine)."""
        expanded = [p for p in problems for _ in range(group_size)]
        episodes = self.rollout(model, expanded, sampling, seed, privileged=privileged)
        return self.to_batch(episodes, group_size=group_size, with_teacher=with_teacher, group_offset=group_offset)

    def to_batch(self, episodes: Sequence[Episode], *, group_size: int, with_teacher: bool | str = False,
                 group_offset: int = 0) -> RolloutBatch:
        """Lay finished episodes out as a RolloutBatch (prompts left-padded, responses right-padded)."""
        pad = self.tok.pad_token_id
        B = len(episodes)
        T = max(1, max(len(e.tokens) for e in episodes))
        K = max(1, max(len(e.turn_rewards) for e in episodes))
        resp = torch.full((B, T), pad, dtype=torch.long)
        gen = torch.zeros((B, T), dtype=torch.bool)
        real = torch.zeros((B, T), dtype=torch.bool)
        tid = torch.zeros((B, T), dtype=torch.long)
        turn_r = torch.full((B, K), float("nan"))
        engine_lp = torch.zeros((B, T)) if self.generator is not None else None
        outcomes, errors = [], 0
        for i, e in enumerate(episodes):
            n = len(e.tokens)
            resp[i, :n] = torch.tensor(e.tokens, dtype=torch.long)
            gen[i, :n] = torch.tensor(e.generated)
            real[i, :n] = True
            tid[i, :n] = torch.tensor(e.turn_of, dtype=torch.long)
            turn_r[i, : len(e.turn_rewards)] = torch.tensor(e.turn_rewards)
            if engine_lp is not None:
                engine_lp[i, :n] = torch.tensor(e.logprobs)
            r, failed = self.guarded_reward(e.env.outcome)
            outcomes.append(r)
            errors += failed + e.env_errors
        self.last_reward_errors = errors
        prompt_ids, prompt_mask = left_pad([e.prompt for e in episodes], pad)
        teacher = {}
        if with_teacher == "sibling":
            raise ValueError("the sibling-solution teacher context (sdpo) is single-turn only")
        if with_teacher:
            tids, tmask = self.encode_prompts([e.problem for e in episodes], privileged=with_teacher)
            teacher = dict(teacher_prompt_ids=tids, teacher_prompt_mask=tmask)
        n_groups = math.ceil(B / group_size)
        group_ids = torch.arange(n_groups).repeat_interleave(group_size)[:B] + group_offset
        texts = [self.tok.decode(e.tokens, skip_special_tokens=False) for e in episodes]
        return RolloutBatch(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=resp, response_mask=gen, attention_mask=real,
            group_ids=group_ids, rewards=torch.tensor(outcomes, dtype=torch.float32), turn_ids=tid, turn_rewards=turn_r,
            rollout_logprobs=engine_lp, **teacher,
            meta={"answers": [e.problem.answer for e in episodes], "texts": texts, "reward_errors": errors,
                  "anchor_obs": [list(e.anchors[: len(e.turn_rewards)]) for e in episodes],
                  "end_reasons": [e.end_reason or "max_turns" for e in episodes],
                  "rollout_stats": episode_stats(episodes)},
        )


def episode_stats(episodes: Sequence[Episode]) -> dict[str, float]:
    """Fractions over episodes (tool use, finishing, end reasons) and means (turns, env tokens)."""
    n = max(1, len(episodes))
    calls = sum(e.calls for e in episodes)
    out = {
        "tool_call_frac": sum(e.calls > 0 for e in episodes) / n,
        "finish_frac": sum(e.finished for e in episodes) / n,
        "valid_call_frac": sum(e.valid_calls for e in episodes) / calls if calls else 0.0,
        "correct_call_frac": sum(e.correct_calls for e in episodes) / calls if calls else 0.0,
        "calls_mean": calls / n,
        "turns_mean": sum(len(e.turn_rewards) for e in episodes) / n,
        "env_tokens_mean": sum(len(e.tokens) - sum(e.generated) for e in episodes) / n,
    }
    for r in END_REASONS:
        out[f"end_{r}_frac"] = sum((e.end_reason or "max_turns") == r for e in episodes) / n
    return out
