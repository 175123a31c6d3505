"""Which rollout engine a run uses: the multi-turn loop for multi-turn tasks, else single-turn sampling; HF
``generate``, gearlab's fast decoder or a vLLM engine as the token generator (``rollout.engine=auto`` chooses
between the first two: ``resolve_engine``). The only module that knows every engine."""
from __future__ import annotations

from typing import Any

from torch import nn

from gearlab.rollout.base import TokenGenerator
from gearlab.rollout.decoder import supports
from gearlab.rollout.fast import FastDecoder, decodes_on_cuda
from gearlab.rollout.hf import HFRolloutEngine
from gearlab.rollout.multiturn import MultiTurnRolloutEngine
from gearlab.rollout.vllm import VLLMGenerator
from gearlab.tasks.base import Task


def make_engine(tokenizer, task: Task, *, batch_size: int = 64, reward_errors: str = "zero", max_turns: int = 0,
                max_total_tokens: int = 0, generator: TokenGenerator | None = None,
                static_cache: bool = False) -> HFRolloutEngine:
    """The rollout engine for ``task``: the multi-turn loop (``gearlab.rollout.multiturn``) when the task
    is multi-turn, else single-turn sampling. ``max_turns=0`` takes the task's default. ``generator``:
    the token generator (None = HF ``generate`` on the policy)."""
    if getattr(task, "multi_turn", False):
        return MultiTurnRolloutEngine(tokenizer, task, batch_size=batch_size, reward_errors=reward_errors,
                                      max_turns=max_turns or task.max_turns, max_total_tokens=max_total_tokens,
                                      generator=generator, static_cache=static_cache)
    return HFRolloutEngine(tokenizer, task, batch_size=batch_size, reward_errors=reward_errors, generator=generator,
                           static_cache=static_cache)


def resolve_engine(cfg: Any, model: nn.Module | None) -> str:
    """``rollout.engine`` made concrete. ``auto`` is ``fast`` when the policy decodes on CUDA (one device, DDP,
    FSDP1 or FSDP2: a sharded policy is gathered for each rollout, ``rollout.fast.sharded_weights``) and gearlab's
    decoder runs ``model``'s layout (``decoder.supports``); otherwise ``hf``. The other values are returned as
    they are."""
    if cfg.rollout.engine != "auto":
        return cfg.rollout.engine
    ok = decodes_on_cuda(cfg) and model is not None and supports(model) is None
    return "fast" if ok else "hf"


def engine_from_config(
    tokenizer, task: Task, cfg, *, training: bool = False, model: nn.Module | None = None
) -> HFRolloutEngine:
    """``make_engine`` with the ``rollout`` / ``trainer`` settings of a gearlab Config. ``training``: the
    engine of a training run, the only one that uses ``rollout.engine=vllm`` (evaluation, inspect and
    replay decode with HF ``generate`` then). ``rollout.engine=fast`` decodes the policy itself, so every
    command uses it. ``model``: the policy, for ``rollout.engine=auto`` (``resolve_engine``; without it, hf)."""
    r = cfg.rollout
    engine = resolve_engine(cfg, model)
    generator: TokenGenerator | None = None
    if training and engine == "vllm":
        generator = VLLMGenerator.from_config(tokenizer, cfg)
    elif engine == "fast":
        generator = FastDecoder.from_config(tokenizer, cfg, training=training)
    return make_engine(tokenizer, task, batch_size=r.batch_size, reward_errors=cfg.trainer.reward_errors,
                       max_turns=r.max_turns, max_total_tokens=r.max_total_tokens, generator=generator,
                       static_cache=training and r.static_cache)
