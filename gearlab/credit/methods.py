"""Methods: what a comparison row, an MLflow ``assigner`` tag and a run folder name. A method is a registered
assigner (its *base*) plus options.

Three ways to name one:
  ``gear``                  a registered assigner, with the options of ``conf/assigner/gear.yaml`` (if any)
  ``gear_random``           a *variant*: ``conf/assigner/gear_random.yaml`` says ``name: gear_random``,
                            ``base: gear`` and its options
  ``gear:q_on=0.8,beta=2``  a *grid point*: the method before the colon with these options on top (what
                            ``compare.grid`` expands to; also usable as ``assigner=gear:q_on=0.8`` anywhere)

Every command (train, compare, report, inspect, replay, credit-eval) takes any of the three; variants and grid
points are separate methods with their own tags and rows.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from gearlab.config import conf_dir, method_yaml, parse_label
from gearlab.credit.api import CreditAssigner, available, build

__all__ = [
    "MethodSpec",
    "available_methods",
    "build_method",
    "expand_grid",
    "grid_label",
    "method_spec",
    "parse_label",
    "unknown_methods"
]


@dataclass(frozen=True)
class MethodSpec:
    """name: the method's label (rows, tags, run folders); base: the registered assigner; options: its options."""

    name: str
    base: str
    options: dict[str, Any] = field(default_factory=dict, hash=False)


def grid_label(method: str, options: dict[str, Any]) -> str:
    """The label of one grid point: ``grid_label("gear", {"q_on": 0.8})`` = ``"gear:q_on=0.8"`` (keys in the given \
order)."""
    return method + ":" + ",".join(f"{k}={_scalar(v)}" for k, v in options.items())


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def method_spec(label: str) -> MethodSpec:
    """The base assigner and options of a method label (see the module docstring). KeyError for an unknown method."""
    node = method_yaml(label)
    if node is not None:
        return MethodSpec(label, node["base"], dict(node["options"]))
    head, extra = parse_label(label)
    if head not in available():
        raise KeyError(f"unknown method {head!r}; known: {', '.join(available_methods())}")
    return MethodSpec(label, head, extra)


def unknown_methods(names: list[str]) -> list[str]:
    """The labels among ``names`` that name no method (unknown head, or a malformed option list)."""
    bad = []
    for n in names:
        try:
            method_spec(n)
        except (KeyError, ValueError):
            bad.append(n)
    return bad


def available_methods() -> list[str]:
    """Registered assigners and the variants of ``conf/assigner/`` (sorted)."""
    names = set(available())
    for p in (conf_dir() / "assigner").glob("*.yaml"):
        names.add(p.stem)
    return sorted(names)


def build_method(spec: MethodSpec | str) -> CreditAssigner:
    """An assigner instance for a method (label or spec)."""
    spec = method_spec(spec) if isinstance(spec, str) else spec
    return build(spec.base, spec.options)


def expand_grid(methods: list[str], grid: dict[str, dict[str, list[Any]]]) -> list[str]:
    """``methods`` with every method named in ``grid`` replaced by one grid point per combination of its option
    values (cartesian product, in the order given), e.g. ``expand_grid(["grpo", "gear"], {"gear": {"q_on": [0.8,
    0.9]}})`` = ``["grpo", "gear:q_on=0.8", "gear:q_on=0.9"]``. A grid method not in ``methods`` is appended."""
    out = []
    for m in list(methods) + [g for g in grid if g not in methods]:
        axes = grid.get(m)
        if not axes:
            out.append(m)
            continue
        keys = list(axes)
        values = [v if isinstance(v, (list, tuple)) else [v] for v in axes.values()]
        for combo in itertools.product(*values):
            out.append(grid_label(m, dict(zip(keys, combo))))
    return out
