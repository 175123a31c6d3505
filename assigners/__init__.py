"""Bundled credit assigners, installed as ``gearlab.assigners``. Importing this package registers every
module in it.

In a checkout the folder is also importable by its own name (``import assigners``, ``from assigners.gear
import ...``): that name is made an alias of ``gearlab.assigners`` and its modules, so a class is never
defined (and registered) twice.
"""
import importlib
import pkgutil
import sys

if __name__ == "assigners":
    _pkg = importlib.import_module("gearlab.assigners")
    sys.modules[__name__] = _pkg
    for _name, _mod in list(sys.modules.items()):
        if _name.startswith("gearlab.assigners."):
            sys.modules["assigners." + _name[len("gearlab.assigners."):]] = _mod
else:
    for _info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{_info.name}")
