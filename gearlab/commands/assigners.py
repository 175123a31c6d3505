"""The credit-method verbs of the ``gearlab`` command: ``assigners [NAME]`` (list the registered methods, or one
method's options), ``check-assigner NAME`` (the contract kit) and ``new-assigner NAME`` (scaffold a method). Each
prints to stdout and returns the process's exit code."""
from __future__ import annotations

import sys
from pathlib import Path


def new_assigner_command(args: list[str]) -> int:
    """``gearlab new-assigner NAME``: write the three files of a new credit method (gearlab.credit.scaffold) and
    say what to run next. Exit 0, or 2 for a bad or taken name."""
    from gearlab.credit.scaffold import new_assigner

    if len(args) != 1:
        print("gearlab: error: usage: gearlab new-assigner NAME", file=sys.stderr)
        return 2
    try:
        paths = new_assigner(args[0], Path.cwd())
    except (ValueError, FileExistsError) as e:
        print(f"gearlab: error: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(f"wrote {p}")
    print(f"next: edit the formula, then `gearlab check-assigner {args[0]}` and `pytest {paths[2]}`")
    return 0


def check_assigner_command(cfg) -> int:
    """``gearlab check-assigner NAME``: run the contract kit on the configured method and print PASS/FAIL per
    check. Exit 0 when all pass, 1 otherwise; an unknown method or option is a ConfigError (exit 2)."""
    from gearlab import credit
    from gearlab.config import ConfigError
    from gearlab.credit.contract import check_assigner

    for spec in cfg.assigner.plugins:
        credit.load_module(spec)
    method, options = cfg.assigner.base or cfg.assigner.name, dict(cfg.assigner.options)
    try:
        credit.build(method, options)
    except (KeyError, ValueError) as e:
        raise ConfigError(str(e).strip('"')) from None
    checks = check_assigner(method, options)
    for c in checks:
        print(f"{'PASS' if c.ok else 'FAIL'}  {c.name}" + (f"  ({c.detail})" if c.detail else ""))
    failed = sum(not c.ok for c in checks)
    print(f"{cfg.assigner.name}: {len(checks) - failed}/{len(checks)} checks passed")
    return 1 if failed else 0


def describe_assigner(name: str, overrides: list[str]) -> int:
    """``gearlab assigners NAME``: the method's signals, promises and every option with its type, default and doc."""
    from gearlab import credit
    from gearlab.config import load_config
    from gearlab.credit.methods import method_spec
    from gearlab.credit.options import describe_options

    cfg = load_config(overrides)
    for spec in cfg.assigner.plugins:
        credit.load_module(spec)
    try:
        method = method_spec(name)  # a registered assigner, a variant or a grid point
        cls = credit.get(method.base)
    except (KeyError, ValueError) as e:
        print(f"gearlab: error: {str(e).strip(chr(34))}", file=sys.stderr)
        return 2
    if method.base != name:
        print(f"{name}: a variant of {method.base} with options {method.options}")
    needs, doc = _needs_and_doc(cls)
    promises = [p for p in ("preserves_sign", "preserves_mass", "requires_turns") if getattr(cls, p)]
    print(f"{name}: {doc}")
    print(f"  needs: {needs}"
          f"   promises: {', '.join(promises) or '-'}   docs: docs/credit/")
    rows = describe_options(cls.Options)
    if not rows:
        print("  options: none")
    for opt, tp, default, text in rows:
        print(f"  {opt:22s} {tp:14s} = {default!r:18s} {text}")
    return 0


def list_assigners(cfg) -> int:
    """``gearlab assigners``: every registered assigner with the signals it needs, then the variants in
    conf/assigner/ (a base with options)."""
    from gearlab import credit
    from gearlab.credit.methods import available_methods, method_spec

    for name in credit.available():
        needs, doc = _needs_and_doc(credit.get(name))
        print(f"{name:14s} needs: {needs:30s} {doc}")
    variants = [m for m in available_methods() if method_spec(m).base != m]
    if variants:
        print("variants (conf/assigner/, a base with options; any METHOD:key=value works too):")
        for m in variants:
            spec = method_spec(m)
            print(f"  {m:14s} = {spec.base} {spec.options}")
    return 0


def _needs_and_doc(cls: type) -> tuple[str, str]:
    """An assigner class's declared signals ("entropy, teacher_kl", or "-") and the first line of its docstring
    (the module's when the class has none)."""
    needs = ", ".join(sorted(str(getattr(s, "value", s)) for s in cls.needs)) or "-"
    doc = (cls.__doc__ or sys.modules[cls.__module__].__doc__ or "").strip().splitlines()[0]
    return needs, doc
