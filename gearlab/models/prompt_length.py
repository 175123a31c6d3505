"""Prompt lengths, checked when a task's data loads: every row of a data file must fit the model's context after the
chat template with room for the response (``max_position_embeddings`` minus ``rollout.max_new_tokens``), and
``task.max_prompt_tokens`` when it is set. The first row over the limit is a one-line ConfigError naming the file, the
row and both lengths; where the tokenizer can be read from a local folder this happens before any weights load.

A prompt far over the limit is refused from its byte length alone, never tokenised: no token covers more bytes than
the longest entry of the vocabulary, so a prompt of B bytes has at least B / (2 × that) tokens (the factor 2 leaves
room for normalisers that shorten text, such as NFC). A multi-megabyte line then costs microseconds, where tokenising
it, and padding every batch to it, took gigabytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from gearlab.config import Config, ConfigError
from gearlab.models.loading import embedded_dir
from gearlab.tasks.base import Problem, Task

__all__ = ["PromptLimit", "check_prompt_lengths", "check_task_prompts", "context_length", "prompt_limit"]

_BATCH = 256  # prompts per tokenizer call (the fast tokenizers parallelise a batch)


@dataclass(frozen=True)
class PromptLimit:
    """The most tokens a prompt may have, and why (the keys that set it), for the error message."""

    tokens: int
    why: str


def context_length(model_config: Any) -> int | None:
    """The model's context in tokens from its Hugging Face config (``max_position_embeddings`` or the older names);
    None when the config states none."""
    if hasattr(model_config, "get_text_config"):  # a multimodal config keeps the language model's in text_config
        model_config = model_config.get_text_config()
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = getattr(model_config, attr, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _response_budget(cfg: Config, task: Task) -> tuple[int, str]:
    """Tokens a rollout may add after the prompt, and the keys that say so."""
    r = cfg.rollout
    if not task.multi_turn:
        return r.max_new_tokens, f"rollout.max_new_tokens {r.max_new_tokens}"
    if r.max_total_tokens:
        return r.max_total_tokens, f"rollout.max_total_tokens {r.max_total_tokens}"
    turns = r.max_turns or task.max_turns
    return r.max_new_tokens * turns, f"rollout.max_new_tokens {r.max_new_tokens} x {turns} turns"


def prompt_limit(cfg: Config, task: Task, context: int | None) -> PromptLimit | None:
    """The tighter of the model's room for a prompt and ``task.max_prompt_tokens``; None when neither is known."""
    limits = []
    if context is not None:
        budget, keys = _response_budget(cfg, task)
        if budget >= context:
            raise ConfigError(f"key 'rollout.max_new_tokens': the response budget ({keys}) leaves no room for a "
                              f"prompt in the model's context of {context} tokens")
        limits.append(PromptLimit(context - budget, f"the model's context {context} minus {keys}"))
    if cfg.task.max_prompt_tokens > 0:
        limits.append(PromptLimit(cfg.task.max_prompt_tokens, "task.max_prompt_tokens"))
    return min(limits, key=lambda lim: lim.tokens) if limits else None


def _longest_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the bytes of text one token covers: the longest vocabulary entry, in UTF-8 bytes of its
    spelling (a byte-level BPE spells each byte as one character of at most 2 bytes, SentencePiece spells a space as
    the 3-byte "▁", byte-fallback tokens as "<0xNN>": each spelling is at least as long as the text it covers)."""
    longest = max((len(t) if isinstance(t, bytes) else len(str(t).encode("utf-8")) for t in tokenizer.get_vocab()),
                  default=1)
    return max(1, longest)


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, bool]:
    """The prompt text exactly as the rollout engines build it, and whether the tokenizer adds its special tokens
    (gearlab.rollout.hf: the chat template, else the messages joined by newlines)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), False
    return "\n".join(m["content"] for m in messages) + "\n", True


def _count_tokens(tokenizer: Any, texts: Sequence[str], add_special: bool) -> list[int]:
    out: list[int] = []
    for s in range(0, len(texts), _BATCH):
        ids = tokenizer(list(texts[s : s + _BATCH]), add_special_tokens=add_special)["input_ids"]
        out += [len(x) for x in ids]
    return out


def check_prompt_lengths(cfg: Config, task: Task, tokenizer: Any, model_config: Any) -> None:
    """Raise a one-line ConfigError naming the first row of the task's data files whose prompt (after the chat
    template) is over :func:`prompt_limit`, its length and the limit, and how many more rows are over it."""
    rows: list[tuple[str, Problem]] = task.sourced_problems()
    if not rows:
        return
    limit = prompt_limit(cfg, task, context_length(model_config))
    if limit is None:
        return
    per_token = 2 * _longest_token_bytes(tokenizer)  # bytes one token may cover at most (module docstring)
    byte_cap = per_token * limit.tokens
    over: dict[int, str] = {}  # row index -> how long its prompt is, in words
    to_count: dict[bool, list[tuple[int, str]]] = {False: [], True: []}
    for i, (_, problem) in enumerate(rows):
        messages = task.messages(problem)
        n_bytes = sum(len(m["content"].encode("utf-8")) for m in messages)
        if n_bytes > byte_cap:
            over[i] = f"{n_bytes:,} bytes, so at least {n_bytes // per_token:,} tokens"
            continue
        text, add_special = _render(tokenizer, messages)
        # no tokenizer makes more tokens than the text has bytes (each byte is at most one token, a special token
        # spans several bytes), plus the BOS/EOS the tokenizer may add or a leading "▁" piece: a prompt this short
        # fits without being tokenised, which spares most rows of most data files
        if len(text.encode("utf-8")) + 4 <= limit.tokens:
            continue
        to_count[add_special].append((i, text))
    for add_special, items in to_count.items():
        counts = _count_tokens(tokenizer, [t for _, t in items], add_special)
        for (i, _), n in zip(items, counts):
            if n > limit.tokens:
                over[i] = f"{n:,} tokens after the chat template"
    if over:
        first = min(over)
        more = f"; {len(over) - 1:,} more row(s) are over it too" if len(over) > 1 else ""
        raise ConfigError(f"{rows[first][0]}: prompt is {over[first]}, over the limit of {limit.tokens:,} tokens "
                          f"({limit.why}){more}")


def _local_model_folder(cfg: Config) -> Path | None:
    """The folder ``model.name_or_path`` loads from when it is already on disk (a local model folder, an embedded
    model made earlier); None for a hub id or an embedded model not made yet."""
    ref = cfg.model.name_or_path
    folder = embedded_dir(cfg, ref) if ref.startswith("embedded:") else Path(ref).expanduser()
    return folder if (folder / "config.json").is_file() else None


def check_task_prompts(cfg: Config, task: Task) -> bool:
    """:func:`check_prompt_lengths` before the model loads, reading only its tokenizer and config from a local
    folder. Returns False when that is not possible (a hub id, an embedded model not made yet, a folder the
    tokenizer cannot be read from): then the caller checks with the loaded model's tokenizer and config."""
    if not task.sourced_problems():
        return True
    folder = _local_model_folder(cfg)
    if folder is None:
        return False
    from transformers import AutoConfig, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=cfg.model.trust_remote_code)
        model_config = AutoConfig.from_pretrained(folder, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError):  # loading the model reports what is wrong with the folder
        return False
    check_prompt_lengths(cfg, task, tokenizer, model_config)
    return True
