"""Accuracy of a policy on a task's problems: greedy or sampled, with HF ``generate`` (left padding), or with the
multi-turn rollout loop for tool tasks. The warm start reports these before and after it trains."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from gearlab.tasks.base import Problem, Task

__all__ = ["evaluate_accuracy", "evaluate_episodes"]


@torch.no_grad()
def evaluate_accuracy(
    model,
    tokenizer,
    task: Task,
    problems: Sequence[Problem],
    *,
    privileged: bool = False,
    greedy: bool = True,
    max_new_tokens: int = 48,
    batch_size: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
) -> float:
    """Mean `task.reward` of generated completions for `problems` (a fraction in [0, 1]).

    greedy=False samples at `temperature` with no top-k/top-p truncation; it reseeds torch's
    global RNG with `seed` so sampled accuracy is reproducible.
    Prompts are left-padded so all rows generate from the same position.
    """
    if not problems:
        return float("nan")
    if getattr(task, "multi_turn", False):
        return evaluate_episodes(model, tokenizer, task, problems, privileged=privileged, greedy=greedy,
                                  max_new_tokens=max_new_tokens, batch_size=batch_size, temperature=temperature,
                                  seed=seed)["accuracy"]
    was_training = model.training
    model.eval()
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    if not greedy:
        torch.manual_seed(seed)
    total = 0.0
    try:
        for start in range(0, len(problems), batch_size):
            chunk = problems[start : start + batch_size]
            texts = [
                tokenizer.apply_chat_template(
                    task.messages(p, privileged=privileged), add_generation_prompt=True, tokenize=False
                )
                for p in chunk
            ]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            sampling: dict[str, Any] = (
                {"do_sample": False}
                if greedy
                else {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
            )
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                **sampling,
            )
            completions = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            total += sum(task.reward(p, c) for p, c in zip(chunk, completions))
    finally:
        tokenizer.padding_side = old_side
        model.train(was_training)
    return total / len(problems)


def evaluate_episodes(model, tokenizer, task: Task, problems: Sequence[Problem], *, privileged: bool | str = False,
                       greedy: bool = True, max_new_tokens: int = 48, batch_size: int = 64, temperature: float = 1.0,
                       seed: int = 0) -> dict[str, float]:
    """Multi-turn tasks: run the episodes with the rollout loop; accuracy (mean outcome) plus tool-use stats."""
    from gearlab.rollout.multiturn import MultiTurnRolloutEngine
    from gearlab.rollout.base import SamplingParams

    engine = MultiTurnRolloutEngine(tokenizer, task, batch_size=batch_size, max_turns=task.max_turns)
    rb = engine.generate(model, problems, group_size=1, seed=seed, privileged=privileged,
                         sampling=SamplingParams(max_new_tokens=max_new_tokens, greedy=greedy, temperature=temperature))
    return {"accuracy": float(rb.rewards.mean()), **rb.meta["rollout_stats"]}
