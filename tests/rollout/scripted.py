"""A scripted "policy" for multi-turn rollout tests: an nn.Module whose ``generate`` emits chosen
token ids, so turn ids, masks, budgets and rewards can be checked on hand-made trajectories."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from gearlab.tasks.base import Problem


class ScriptedPolicy(nn.Module):
    """``script(context_text, turn) -> token ids of this turn (stop token included or not)``.

    ``turn`` = number of assistant headers in the context minus one. Rows are padded with the pad id
    after their ids; generation is cut at ``max_new_tokens`` like HF ``generate``."""

    def __init__(self, tokenizer, script: Callable[[str, int], list[int]]) -> None:
        super().__init__()
        self.tok, self.script = tokenizer, script
        self.dummy = nn.Parameter(torch.zeros(1))
        self.calls: list[int] = []  # batch size of every generate() call

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, **_):
        self.calls.append(input_ids.shape[0])
        rows = []
        for ids, m in zip(input_ids, attention_mask):
            text = self.tok.decode(ids[m.bool()].tolist(), skip_special_tokens=False)
            turn = text.count("<|im_start|>assistant") - 1
            rows.append(self.script(text, turn)[:max_new_tokens])
        width = max(1, max(len(r) for r in rows))
        out = torch.full((input_ids.shape[0], width), pad_token_id, dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        return torch.cat([input_ids, out], dim=1)


def action_ids(tok, text: str, stop: bool = True) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if stop else [])


def demo_script(tok, task, problems: list[Problem]) -> Callable[[str, int], list[int]]:
    """A perfect tool user: plays the task's demonstration of whichever problem is in the context."""
    by_prompt = {p.prompt: task.demo_actions(p) for p in problems}

    def script(text: str, turn: int) -> list[int]:
        acts = next(a for prompt, a in by_prompt.items() if prompt in text)
        return action_ids(tok, acts[min(turn, len(acts) - 1)])

    return script
