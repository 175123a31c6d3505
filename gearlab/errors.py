"""The error every layer may raise for bad input: the CLI prints it on one line and exits with code 2."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem; the CLI prints it on one line and exits with code 2."""
