"""The task registry: ``@register_task(name, **defaults)`` on a ``Task`` class, ``get_task(name, **options)`` to
build one, ``available_tasks()`` to list them.

Built-in tasks are the modules of this package (each registers itself on import); other packages add tasks
through the ``gearlab.tasks`` entry-point group, and a single file can be loaded with ``task.plugins=[file.py]``.
Adding a task needs no edit of any list: one module plus ``conf/task/<name>.yaml``.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

from gearlab.errors import ConfigError
from gearlab.plugins import import_plugin, load_plugins
from gearlab.tasks.base import Task

ENTRY_POINT_GROUP = "gearlab.tasks"
TASKS: dict[str, type[Task]] = {}
_DEFAULTS: dict[str, dict[str, Any]] = {}

T = TypeVar("T", bound=type[Task])


def register_task(name: str, **defaults: Any) -> Callable[[T], T]:
    """Class decorator: register a Task class under `name`, with default constructor options.

    The same class may be registered under several names with different defaults
    (e.g. "arith" and "arith_hard"). A name taken by a different class is an error.
    """

    def deco(cls: T) -> T:
        old = TASKS.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"task {name!r} is already registered ({old.__module__}.{old.__qualname__})")
        TASKS[name] = cls
        _DEFAULTS[name] = dict(defaults)
        return cls

    return deco


def load_builtin_and_installed() -> None:
    """Import every module of this package (the built-in tasks register on import) and every module of the
    ``gearlab.tasks`` entry-point group. Idempotent."""
    load_plugins(__name__.rpartition(".")[0], ENTRY_POINT_GROUP)  # this package's modules + the group


def available_tasks() -> list[str]:
    """Sorted names of every registered task."""
    load_builtin_and_installed()
    return sorted(TASKS)


def task_from_config(cfg: Any) -> Task:
    """The task of a gearlab Config: imports ``task.plugins`` first, then builds ``task.name`` with
    ``task.options``; any problem is a one-line ConfigError naming the key."""
    for spec in cfg.task.plugins:
        try:
            import_plugin(spec)
        except (ImportError, FileNotFoundError) as e:
            raise ConfigError(f"key 'task.plugins': cannot import {spec!r}: {e}") from None
    try:
        return get_task(cfg.task.name, **dict(cfg.task.options))
    except ConfigError:  # a task that names the key itself
        raise
    except (KeyError, TypeError, ValueError, OSError) as e:  # OSError: a data file missing or unreadable
        raise ConfigError(f"key 'task': {str(e).strip(chr(34))}") from None


def get_task(name: str, **options: Any) -> Task:
    """Instantiate the task registered as `name`; `options` override its registered defaults."""
    if name not in TASKS:
        load_builtin_and_installed()
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}")
    kwargs = {**_DEFAULTS[name], **options}
    task = TASKS[name](**kwargs)
    task.name = name
    return task
