"""Loading plug-ins: every module of a built-in package plus an entry-point group (``load_plugins``, used by the
assigner, task and signal registries alike), and a module named on the command line (``assigner.plugins``,
``task.plugins``: a dotted import path or a ``.py`` file anywhere on disk). Importing a plug-in runs its
``@register...`` decorator."""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import pkgutil
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


_LOADED: set[tuple[str, str]] = set()


def load_plugins(package: str, group: str) -> None:
    """Import every module of ``package`` (built-in plug-ins register themselves on import) and every module
    of the entry-point ``group`` (plug-ins of other installed packages), once per process. The one loader of all
    plug-in kinds."""
    if (package, group) in _LOADED:
        return
    _LOADED.add((package, group))
    pkg = importlib.import_module(package)
    for info in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{package}.{info.name}")
    for ep in importlib.metadata.entry_points(group=group):
        ep.load()
