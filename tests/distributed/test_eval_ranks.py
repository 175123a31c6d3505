"""Held-out evaluation split across ranks and aggregated with torchmetrics equals one process on all
problems (a deterministic scripted policy, 2 gloo processes)."""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.envs.scripted import ScriptedPolicy, action_ids


def _evaluate(out: str | None):
    from gearlab.config import load_config
    from gearlab.evaluate import evaluate_model
    from gearlab.models.tiny import build_tokenizer
    from gearlab.tasks.base import get_task

    tok = build_tokenizer()
    task = get_task("arith")
    cfg = load_config(["eval.num_problems=10", "eval.k=3", "rollout.max_new_tokens=16"])
    answers = {p.prompt: p.answer for p in task.problems("test", 10, cfg.trainer.seed)}

    def script(text: str, turn: int) -> list[int]:  # right on some problems, wrong on the others
        prompt = next(p for p in answers if p in text)
        ans = answers[prompt] if sum(map(ord, prompt)) % 3 else "12345"
        return action_ids(tok, f"Answer: {ans}")

    res = evaluate_model(ScriptedPolicy(tok, script), tok, task, cfg)
    if out:
        torch.save(res, out)
    return res


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _evaluate(out if rank == 0 else None)
    finally:
        dist.destroy_process_group()


def test_two_ranks_aggregate_to_the_single_process_numbers(tmp_path):
    single = _evaluate(None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "r.pt")
    mp.spawn(_worker, args=(2, port, out), nprocs=2, join=True)
    two = torch.load(out)
    assert 0 < single["greedy_accuracy"] < 1  # the scripted policy is right on some problems only
    for k in ("greedy_accuracy", "avg@3", "pass@3", "problems"):
        assert two[k] == single[k], k
