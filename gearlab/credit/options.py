"""Typed assigner options: each assigner declares a dataclass ``Options`` whose fields are its options — type,
default and a one-line doc in one place — and ``parse_options`` checks a config's ``assigner.options`` against
it before any work: an unknown key, a wrong type or a value out of range is an ``OptionError`` naming
``assigner.options.<key>``.

    @dataclass
    class Options:
        beta: float = option(1.0, "strength of the modulation", lo=0.0)
        mode: str = option("exp", "the modulation's form", choices=("exp", "linear"))

Types understood: bool, int (not bool), float (an int is accepted), str, ``X | None``, list[...] / tuple[...]
(a list or tuple). Ranges are closed unless ``lo_open`` / ``hi_open``.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Mapping, Sequence


class OptionError(ValueError):
    """A bad assigner option; ``key`` is the config path (``assigner.options.<name>``)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key, self.message = key, message


def plain(x: Any) -> Any:
    """A config node (OmegaConf's DictConfig / ListConfig) as plain dicts and lists, for options whose values are
    nested structures (a list of components, a mapping of options)."""
    if isinstance(x, Mapping):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, Sequence) and not isinstance(x, (str, bytes)):
        return [plain(v) for v in x]
    return x


def option(default: Any, doc: str, *, choices: tuple | None = None, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False, hi_open: bool = False) -> Any:
    """A dataclass field for an assigner option (use as the field's default)."""
    meta = {"doc": doc, "choices": choices, "lo": lo, "hi": hi, "lo_open": lo_open, "hi_open": hi_open}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin in (list, tuple) or tp in (list, tuple):
        return isinstance(value, (list, tuple))
    return True  # anything else is not checked here


def _type_name(tp: Any) -> str:
    return str(tp).replace("typing.", "") if typing.get_origin(tp) else getattr(tp, "__name__", str(tp))


def check_value(key: str, value: Any, tp: Any, meta: Mapping[str, Any]) -> Any:
    """``value`` converted to the field's type (int → float), or OptionError."""
    if not _type_ok(value, tp):
        raise OptionError(key, f"expected {_type_name(tp)}, got {value!r}")
    if tp is float or (
        isinstance(value, (int, float)) and not isinstance(value, bool) and float in typing.get_args(tp)
    ):
        value = float(value)
        if math.isnan(value):
            raise OptionError(key, "must be a number, got nan")
    if meta.get("choices") is not None and value not in meta["choices"]:
        raise OptionError(key, f"{value!r} is not one of {', '.join(map(str, meta['choices']))}")
    lo, hi = meta.get("lo"), meta.get("hi")
    if value is not None and not isinstance(value, (str, bool, list, tuple)):
        if lo is not None and (value <= lo if meta.get("lo_open") else value < lo):
            raise OptionError(key, f"must be {'>' if meta.get('lo_open') else '>='} {lo}, got {value}")
        if hi is not None and (value >= hi if meta.get("hi_open") else value > hi):
            raise OptionError(key, f"must be {'<' if meta.get('hi_open') else '<='} {hi}, got {value}")
    return value


def parse_options(cls: type, values: Mapping[str, Any] | None, owner: str, prefix: str = "assigner.options") -> Any:
    """An instance of the options dataclass ``cls`` from ``values`` (missing keys take their defaults)."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for k, v in dict(values or {}).items():
        if k not in known:
            raise OptionError(f"{prefix}.{k}", f"assigner {owner!r} has no option {k!r}; its options: "
                                               f"{', '.join(known) or 'none'}")
        kwargs[k] = check_value(f"{prefix}.{k}", v, hints[k], known[k].metadata)
    return cls(**kwargs)


def describe_options(cls: type | None) -> list[tuple[str, str, Any, str]]:
    """(name, type, default, doc) of every option of the dataclass ``cls`` (empty for None)."""
    if cls is None:
        return []
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        meta = f.metadata
        doc = meta.get("doc", "")
        if meta.get("choices"):
            doc += f" [{' | '.join(map(str, meta['choices']))}]"
        out.append((f.name, _type_name(hints[f.name]), default, doc))
    return out
