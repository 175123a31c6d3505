"""Supervised warm start of a (tiny) policy so GRPO has something to improve.

`warmstart` fine-tunes on chat-formatted (prompt -> worked solution) pairs with the loss on the
assistant tokens only. Half of the examples use the privileged prompt (question + ground-truth
answer), so the self-distillation teacher (same weights, privileged context) is meaningful:
it learns to use the reference answer. It deliberately under-trains: the default budget leaves
the plain-prompt accuracy partial, which is the regime where RL has signal.

Its accuracies before and after come from ``gearlab.models.accuracy``.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor

from gearlab.models.accuracy import evaluate_accuracy, evaluate_episodes
from gearlab.stopping import Stopped, pending_stop
from gearlab.tasks.base import Problem, Task
from gearlab.tasks.registry import get_task

__all__ = [
    "encode_sft_example",
    "collate_sft",
    "sft_loss",
    "warmstart",
    "warmstart_kernels",
]


# ---------------------------------------------------------------------------------------------
# data


def encode_sft_example(tokenizer, task: Task, problem: Problem, privileged: bool) -> tuple[list[int], int | list[bool]]:
    """Token ids of (chat prompt with generation header) ⊕ (solution, eos), and the prompt length.

    The two parts are tokenised separately, exactly as at rollout time (the policy generates
    after the prompt ids), so the trained-on tokens are the tokens the policy will produce.
    Multi-turn tasks: the task's demonstrated episode laid out as a rollout lays it out
    (``gearlab.rollout.multiturn.encode_demo``), and a per-token label mask instead of a prompt length.
    """
    if getattr(task, "multi_turn", False):
        from gearlab.rollout.multiturn import encode_demo

        return encode_demo(tokenizer, task, problem, task.demo_actions(problem), privileged=privileged)
    prompt_ids = tokenizer.apply_chat_template(
        task.messages(problem, privileged=privileged), add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer(prompt_ids, add_special_tokens=False).input_ids
    target_ids = tokenizer(problem.solution, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    return prompt_ids + target_ids, len(prompt_ids)


def collate_sft(examples: Sequence[tuple[list[int], int | list[bool]]], pad_id: int) -> dict[str, Tensor]:
    """Right-pad a batch. Returns input_ids/attention_mask/labels, each [B, L]; labels are -100
    on prompt and padding positions (loss on the assistant tokens only). Each example is (ids,
    prompt length) or (ids, per-token label mask) — the latter for multi-turn demonstrations."""
    L = max(len(ids) for ids, _ in examples)
    B = len(examples)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    labels = torch.full((B, L), -100, dtype=torch.long)
    for i, (ids, n_prompt) in enumerate(examples):
        t = torch.tensor(ids, dtype=torch.long)
        input_ids[i, : len(ids)] = t
        attention_mask[i, : len(ids)] = 1
        if isinstance(n_prompt, int):
            labels[i, n_prompt : len(ids)] = t[n_prompt:]
        else:
            keep = torch.tensor(n_prompt, dtype=torch.bool)
            labels[i, : len(ids)] = torch.where(keep, t, torch.full_like(t, -100))
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def sft_loss(model, batch: dict[str, Tensor]) -> Tensor:
    """Mean next-token cross-entropy over the labelled (assistant) tokens; scalar."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    # position t predicts token t+1
    logits = logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100
    )


# ---------------------------------------------------------------------------------------------
# training


def _lr_at(step: int, progress: float, lr: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to `min_ratio * lr` as `progress`
    (fraction of the run done, in [0, 1]) goes from 0 to 1."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, max(0.0, progress))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@contextlib.contextmanager
def warmstart_kernels(dev: torch.device) -> Iterator[None]:
    """On CUDA, deterministic kernels for the body (the previous setting restored after): the same warm start on
    every machine of one card kind, which ``gearlab compare`` checks by digest. Attention runs on SDPA's math
    backend: the fused backwards (cuDNN, flash, memory-efficient) keep non-deterministic reductions unless
    deterministic algorithms are enforced without ``warn_only``, which would make every other op without a
    deterministic kernel an error. (Two 100-step SmolLM2 warm starts on two H200s differed through cuDNN attention's
    backward.) A no-op elsewhere: the CPU kernels are pinned by ``gearlab.cpu_kernels``. Not training's
    ``gearlab.trainer.determinism.deterministic_kernels`` (strict, any attention backend): changing this one would
    change every committed warm start's digest."""
    if dev.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS makes its first handle
    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


def _sft_loop(model: Any, tokenizer: Any, task: Task, out: Path, dev: torch.device, *, steps: int, batch_size: int,
              lr: float, seed: int, max_minutes: float | None, log_every: int, privileged_fraction: float,
              warmup_steps: int, weight_decay: float, bf16: bool) -> list[float]:
    """The SFT steps of `warmstart` (AdamW, linear warmup then cosine decay, grad norm clipped at 1): the loss of
    each step done. Stops early after ``max_minutes`` of training; raises `Stopped` on a stop signal."""
    # One stream of train problems for the whole run, deterministic in `seed`.
    problems = task.problems("train", steps * batch_size, seed=seed)
    rng = random.Random(seed)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.98),
        fused=True,  # the same digits on every CPU class (gearlab.cpu_kernels)
    )
    model.train()
    losses: list[float] = []
    t_train = time.perf_counter()
    for step in range(steps):
        if signum := pending_stop():  # a Ctrl-C / SIGTERM to `gearlab train` or `compare` while it warm-starts
            raise Stopped(signum, f"the warm start of {out} (step {step} of {steps}; nothing was written)")
        elapsed = time.perf_counter() - t_train
        if max_minutes is not None and elapsed > 60 * max_minutes:
            break
        # With a time cap the schedule follows whichever budget runs out first, so a run cut
        # short on a busy machine still ends with a decayed learning rate.
        progress = (step - warmup_steps) / max(1, steps - warmup_steps)
        if max_minutes is not None:
            progress = max(progress, elapsed / (60 * max_minutes))
        chunk = problems[step * batch_size : (step + 1) * batch_size]
        batch = collate_sft(
            [encode_sft_example(tokenizer, task, p, rng.random() < privileged_fraction) for p in chunk],
            tokenizer.pad_token_id,
        )
        batch = {k: v.to(dev) for k, v in batch.items()}
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, progress, lr, warmup_steps)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            loss = sft_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(
                f"[warmstart] step {step:4d}/{steps}  loss {loss.item():.4f}  "
                f"lr {opt.param_groups[0]['lr']:.2e}  {time.perf_counter() - t_train:.1f}s",
                flush=True,
            )
    return losses


def warmstart(
    out_dir: str | Path,
    *,
    task: Task | str = "arith",
    model_dir: str | Path | None = None,
    steps: int = 600,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    max_minutes: float | None = None,
    log_every: int = 25,
    privileged_fraction: float = 0.5,
    warmup_steps: int = 20,
    weight_decay: float = 0.01,
    bf16: bool = False,
    n_eval: int = 200,
    eval_max_new_tokens: int = 48,
    model_kwargs: dict[str, Any] | None = None,
    device: str = "cpu",
    save: bool = True,
    verbose: bool = True,
) -> dict[str, Any]:
    """Short SFT warm start; saves model + tokenizer + `warmstart.json` into `out_dir`.

    Starts from `model_dir` (any local causal LM folder) or, if None, from a fresh
    `build_tiny_model(**model_kwargs)` with the default tokenizer. Each step draws `batch_size`
    new train problems; each example uses the privileged prompt with prob `privileged_fraction`.
    AdamW with linear warmup and cosine decay; stops early once `max_minutes` of training have
    passed. Then measures on `n_eval` held-out test problems: greedy and sampled (T=1) accuracy on
    plain prompts and greedy accuracy on privileged prompts (skipped when n_eval=0).

    Defaults (task "arith", tiny 1.24M-param model, 600 steps x 32, lr 3e-3, fp32, seed 0, 2 threads) take about
    2 minutes on 2 idle CPU cores with the pinned kernels and give 58% plain greedy accuracy, 47.5% sampled and 98.5%
    privileged greedy accuracy on 200 held-out problems: the weights shipped in gearlab/models/data/tiny-arith.
    bf16 autocast was measured no faster than fp32 for this model size, hence off by default.
    ``device`` ("cpu", "cuda", "auto" = cuda when available): where the SFT and the evaluation run.

    Returns the dict written to warmstart.json (accuracies, losses, steps done, timings).
    """
    t_start = time.perf_counter()
    task = get_task(task) if isinstance(task, str) else task
    out = Path(out_dir)

    model, tokenizer = _start(model_dir, seed, model_kwargs)
    n_params = sum(p.numel() for p in model.parameters())
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device
    )
    model.to(dev)
    t_train = time.perf_counter()
    with warmstart_kernels(dev):
        losses = _sft_loop(model, tokenizer, task, out, dev, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                           max_minutes=max_minutes, log_every=log_every if verbose else 0,
                           privileged_fraction=privileged_fraction, warmup_steps=warmup_steps,
                           weight_decay=weight_decay, bf16=bf16)
    steps_done = len(losses)
    train_seconds = time.perf_counter() - t_train

    result: dict[str, Any] = {
        "task": getattr(task, "name", type(task).__name__),
        "task_repr": repr(task),
        "model_dir": str(model_dir) if model_dir is not None else None,
        "n_params": n_params,
        "steps": steps_done,
        "steps_requested": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "bf16": bf16,
        "privileged_fraction": privileged_fraction,
        "device": str(dev),
        "threads": torch.get_num_threads(),  # float reduction order, hence the result, depends on it
        "loss_first": losses[0] if losses else None,
        # mean of the last 10 steps: single-batch losses are noisy
        "loss_last": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "train_seconds": round(train_seconds, 2),
    }

    if n_eval > 0:
        t_eval = time.perf_counter()
        result.update(_held_out_accuracy(model, tokenizer, task, n_eval, seed, eval_max_new_tokens))
        result["n_eval"] = n_eval
        result["eval_seconds"] = round(time.perf_counter() - t_eval, 2)
    result["wall_seconds"] = round(time.perf_counter() - t_start, 2)

    if save:
        result["weights_sha256"] = _save(out, model, tokenizer, result)
    if verbose:
        print("[warmstart] " + json.dumps({k: v for k, v in result.items() if k != "task_repr"}), flush=True)
    return result


def _start(model_dir: str | Path | None, seed: int, model_kwargs: dict[str, Any] | None) -> tuple[Any, Any]:
    """(model in fp32, tokenizer): a fresh tiny model (seeded) with the default tokenizer, or a local folder's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gearlab.models.tiny import build_tiny_model, build_tokenizer

    torch.manual_seed(seed)
    if model_dir is None:
        tokenizer = build_tokenizer()
        return build_tiny_model(tokenizer, seed=seed, **(model_kwargs or {})), tokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token_id is None:  # as load_policy does: padding (SFT batches, evaluation) needs one
        tokenizer.pad_token = tokenizer.eos_token
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), tokenizer


def _held_out_accuracy(model, tokenizer, task: Task, n_eval: int, seed: int, max_new_tokens: int) -> dict[str, Any]:
    """Greedy and sampled (T = 1) accuracy on plain prompts and greedy accuracy on privileged prompts, over
    ``n_eval`` test problems; multi-turn tasks add how the greedy episodes used their tools."""
    test = task.problems("test", n_eval, seed=seed)
    kw = dict(max_new_tokens=max_new_tokens)
    res: dict[str, Any] = {}
    if getattr(task, "multi_turn", False):
        ep = evaluate_episodes(model, tokenizer, task, test, **kw)
        res["acc_plain_greedy"] = ep["accuracy"]
        res.update({f"greedy_{k}": round(v, 4) for k, v in ep.items()
                    if k in ("tool_call_frac", "finish_frac", "valid_call_frac", "correct_call_frac", "turns_mean")})
    else:
        res["acc_plain_greedy"] = evaluate_accuracy(model, tokenizer, task, test, **kw)
    res["acc_plain_sampled"] = evaluate_accuracy(model, tokenizer, task, test, greedy=False, seed=seed, **kw)
    res["acc_privileged_greedy"] = evaluate_accuracy(model, tokenizer, task, test, privileged=True, **kw)
    return res


def _save(out: Path, model, tokenizer, result: dict[str, Any]) -> str:
    """Model, tokenizer and warmstart.json (with the weights' sha256) into ``out``, through a temporary folder swapped
    in whole: a killed save never leaves a config.json without weights. Returns the weights' sha256."""
    from gearlab.models.checkpoints import weights_digest

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    digest = weights_digest(tmp)
    (tmp / "warmstart.json").write_text(json.dumps({**result, "weights_sha256": digest}, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return digest


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m gearlab.models.warmstart OUT_DIR [--steps N ...]`: run `warmstart` from the shell."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--task", default="arith")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-minutes", type=float, default=None)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--n-eval", type=int, default=200)
    a = ap.parse_args(argv)
    warmstart(
        a.out_dir, task=a.task, model_dir=a.model_dir, steps=a.steps, batch_size=a.batch_size,
        lr=a.lr, seed=a.seed, max_minutes=a.max_minutes, log_every=a.log_every, bf16=a.bf16,
        n_eval=a.n_eval,
    )


if __name__ == "__main__":
    main()
