"""``gearlab export``: a training checkpoint (one file, or a sharded FSDP2 directory) → a consolidated
Hugging Face model folder (``save_pretrained`` + tokenizer) that any HF tool loads."""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from gearlab.config import Config, ConfigError


def policy_state_from_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """The policy's full state dict from a Lightning checkpoint written by ``gearlab train``.

    A directory is a torch distributed checkpoint (per-rank shards + metadata); it is consolidated in a
    single process (no process group needed). Keys lose the module's ``policy.`` prefix."""
    path = Path(path)
    if path.is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(path, Path(tmp) / "full.pt")
            state = torch.load(Path(tmp) / "full.pt", map_location="cpu", weights_only=False)["state_dict"]
    elif path.is_file():
        state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    else:
        raise ConfigError(f"checkpoint not found: {path}")
    policy = {k[len("policy."):]: v for k, v in state.items() if k.startswith("policy.")}
    if not policy:
        raise ConfigError(f"{path}: no policy weights in this checkpoint (is it a gearlab training checkpoint?)")
    return policy


def export(cfg: Config) -> Path:
    """Write ``export.out`` from ``export.checkpoint``; the architecture and tokenizer come from
    ``model.name_or_path`` (the model the run started from)."""
    from gearlab.train import check_model_folder, load_policy

    if not cfg.export.checkpoint or not cfg.export.out:
        raise ConfigError("gearlab export needs export.checkpoint=PATH and export.out=DIR")
    if not cfg.model.name_or_path.startswith("embedded:"):
        check_model_folder(cfg.model.name_or_path)  # before the (possibly large) checkpoint is read
    state = policy_state_from_checkpoint(cfg.export.checkpoint)
    model, tok, _ = load_policy(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ConfigError(f"{cfg.export.checkpoint}: does not match model {cfg.model.name_or_path!r} "
                          f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})")
    out = Path(cfg.export.out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
