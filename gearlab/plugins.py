"""Importing a plug-in module named on the command line (``assigner.plugins``, ``task.plugins``): a dotted
import path, or a ``.py`` file anywhere on disk. Importing it runs its ``@register...`` decorators."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path


def import_plugin(spec: str) -> None:
    """Import ``spec`` (``pkg.module`` or ``path/to/file.py``) once; a missing file raises FileNotFoundError,
    a missing module ImportError."""
    if spec.endswith(".py"):
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"plug-in file not found: {spec}")
        mod_name = f"gearlab_plugin_{path.stem}"
        if mod_name in sys.modules:
            return
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        module_spec.loader.exec_module(module)
    else:
        importlib.import_module(spec)
