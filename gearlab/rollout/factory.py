"""Which rollout engine a run uses: the multi-turn loop for multi-turn tasks, else single-turn sampling; HF
``generate`` or a vLLM engine as the token generator. The only module that knows every engine."""
from __future__ import annotations

from gearlab.rollout.base import TokenGenerator
from gearlab.rollout.fast import FastDecoder
from gearlab.rollout.hf import HFRolloutEngine
from gearlab.rollout.multiturn import MultiTurnRolloutEngine
from gearlab.rollout.vllm import VLLMGenerator
from gearlab.tasks.base import Task


def make_engine(tokenizer, task: Task, *, batch_size: int = 64, reward_errors: str = "zero", max_turns: int = 0,
                max_total_tokens: int = 0, generator: TokenGenerator | None = None, static_cache: bool = False) -> HFRolloutEngine:
    """The rollout engine for ``task``: the multi-turn loop (``gearlab.rollout.multiturn``) when the task
    is multi-turn, else single-turn sampling. ``max_turns=0`` takes the task's default. ``generator``:
    the token generator (None = HF ``generate`` on the policy)."""
    if getattr(task, "multi_turn", False):
        return MultiTurnRolloutEngine(tokenizer, task, batch_size=batch_size, reward_errors=reward_errors,
                                      max_turns=max_turns or task.max_turns, max_total_tokens=max_total_tokens,
                                      generator=generator, static_cache=static_cache)
    return HFRolloutEngine(tokenizer, task, batch_size=batch_size, reward_errors=reward_errors, generator=generator,
                           static_cache=static_cache)


def engine_from_config(tokenizer, task: Task, cfg, *, training: bool = False) -> HFRolloutEngine:
    """``make_engine`` with the ``rollout`` / ``trainer`` settings of a gearlab Config. ``training``: the
    engine of a training run, the only one that uses ``rollout.engine=vllm`` (evaluation, inspect and
    replay decode with HF ``generate`` then). ``rollout.engine=fast`` decodes the policy itself, so every
    command uses it."""
    r = cfg.rollout
    generator: TokenGenerator | None = None
    if training and r.engine == "vllm":
        generator = VLLMGenerator.from_config(tokenizer, cfg)
    elif r.engine == "fast":
        generator = FastDecoder.from_config(tokenizer, cfg)
    return make_engine(tokenizer, task, batch_size=r.batch_size, reward_errors=cfg.trainer.reward_errors,
                       max_turns=r.max_turns, max_total_tokens=r.max_total_tokens, generator=generator,
                       static_cache=training and r.static_cache)
