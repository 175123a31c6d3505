"""``gearlab export``: a training checkpoint (one file, or a sharded FSDP2 directory) → a consolidated
Hugging Face model folder (``save_pretrained`` + tokenizer) that any HF tool loads."""
from __future__ import annotations

from pathlib import Path

from gearlab.config import Config, ConfigError
from gearlab.models.checkpoints import policy_state_from_checkpoint
from gearlab.models.loading import check_model_folder, load_policy


def export(cfg: Config) -> Path:
    """Write ``export.out`` from ``export.checkpoint``; the architecture and tokenizer come from
    ``model.name_or_path`` (the model the run started from)."""
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
