"""What a run was made with: package versions and gearlab's git commit, recorded on every MLflow run as
tags ``versions.<name>`` so a comparison can tell when its runs were not made with the same software.

Cheap on purpose (``importlib.metadata`` reads the installed distributions' metadata, nothing is
imported) and imports only gearlab.cpu_kernels (no torch, no other gearlab module), so any module can use it without a \
cycle."""
from __future__ import annotations

import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from gearlab import cpu_kernels

# distribution names read with importlib.metadata, in the order they are recorded
PACKAGES = ("torch", "transformers", "tokenizers", "lightning", "mlflow", "omegaconf", "numpy")
TAG_PREFIX = "versions."
MISSING = "missing"


def git_sha() -> str:
    """gearlab's git commit (12 hex digits), "unknown" outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def package_versions() -> dict[str, str]:
    """{name: version} of the packages a run depends on ("missing" when not installed), the Python version,
    ``gearlab``: gearlab's git commit (the same value as the ``git_sha`` tag), and what else moves CPU numbers:
    ``cpu_model``, the pinned kernel variables (gearlab.cpu_kernels) and — when torch is loaded — ``torch_threads``
    (intra-op threads) and ``cpu_capability`` (the ISA ATen dispatches to)."""
    out: dict[str, str] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = MISSING
    out["python"] = platform.python_version()
    out["gearlab"] = git_sha()
    out.update(cpu_kernels.describe())
    torch = sys.modules.get("torch")  # already imported by any training process; never imported here
    if torch is not None:  # CPU numbers depend on float reduction order: the intra-op thread count too
        out["torch_threads"] = str(torch.get_num_threads())
    return out


def version_tags(versions: dict[str, str] | None = None) -> dict[str, str]:
    """The MLflow tags of :func:`package_versions`: ``versions.torch`` → ``2.13.0+cpu`` …"""
    return {TAG_PREFIX + k: v for k, v in (package_versions() if versions is None else versions).items()}
