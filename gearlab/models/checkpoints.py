"""Reading training checkpoints: the policy's weights out of a Lightning checkpoint file or a sharded (FSDP2)
checkpoint directory."""
from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import torch

from gearlab.config import ConfigError


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


def weights_digest(model_dir: str | Path) -> str | None:
    """sha256 over the bytes of a Hugging Face folder's weight files (``*.safetensors``, else ``*.bin``, in name
    order); None for a folder without them (or a hub id). Two folders with the same digest hold the same weights
    bit for bit: what the runs of one comparison must share."""
    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors")) or sorted(d.glob("*.bin")) if d.is_dir() else []
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()
