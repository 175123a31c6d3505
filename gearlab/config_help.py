"""Help text of the typed config: every key of chosen ``Config`` sections with its type, default and doc.

The docs are the comments written next to each field in ``gearlab/config_schema.py`` (the lines directly above a field
and the comment at the end of its line), read from the module's source with ``ast`` + ``tokenize``, so the
schema stays the one place where a key is declared and explained.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import re
import textwrap
import tokenize
import typing
from typing import Any, Sequence

from gearlab import config as config_module
from gearlab import config_schema

_OPTIONAL = re.compile(r"^Optional\[(.*)\]$")


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    """One config key: its dotted path, type as written in the schema, default value and doc."""

    key: str
    type: str
    default: Any
    doc: str


@functools.lru_cache(maxsize=1)
def _field_docs() -> dict[str, dict[str, tuple[str, str]]]:
    """class name -> field name -> (type as written, doc from its comments), parsed from config_schema.py's source.
    Empty when the source is not available (a byte-code-only install): the keys are then listed without docs."""
    try:
        source = inspect.getsource(config_schema)
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}  # line number -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out: dict[str, dict[str, tuple[str, str]]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = {}
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above = []
            n = stmt.lineno - 1  # comment-only lines directly above the field (a blank line ends them)
            while n >= 1 and lines[n - 1].strip().startswith("#"):
                above.insert(0, comments.get(n, ""))
                n -= 1
            trailing = [comments[i] for i in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1) if i in comments]
            tp = ast.unparse(stmt.annotation)
            m = _OPTIONAL.match(tp)
            # the lines above are one sentence wrapped; a trailing comment is a remark of its own
            doc = "; ".join(part for part in (" ".join(above), " ".join(trailing)) if part)
            fields[stmt.target.id] = (f"{m.group(1)} | None" if m else tp, doc)
        out[node.name] = fields
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _walk(cls: type, prefix: str) -> list[KeyDoc]:
    docs = _field_docs().get(cls.__name__, {})
    hints = typing.get_type_hints(cls)
    rows: list[KeyDoc] = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):  # a nested section, e.g. rollout.vllm
            rows.extend(_walk(hints[f.name], key))
            continue
        tp, doc = docs.get(f.name, (getattr(hints[f.name], "__name__", str(hints[f.name])), ""))
        choices = config_module._CHOICES.get(key)
        if choices and not all(str(c) in doc for c in choices):  # the comment does not list them already
            doc = f"{doc} [{' | '.join(map(str, choices))}]".strip()
        rows.append(KeyDoc(key, tp, _default(f), doc))
    return rows


def section_names() -> list[str]:
    """The top-level sections of ``Config`` in schema order (model, task, rollout, ...)."""
    return [f.name for f in dataclasses.fields(config_module.Config)]


def describe_sections(sections: Sequence[str]) -> list[KeyDoc]:
    """Every key of the given top-level sections of ``Config`` (nested sections flattened), in schema order."""
    hints = typing.get_type_hints(config_module.Config)
    unknown = [s for s in sections if s not in hints]
    if unknown:
        raise KeyError(f"no config section {', '.join(unknown)}; sections: {', '.join(section_names())}")
    return [row for s in sections for row in _walk(hints[s], s)]


def section_doc(section: str) -> str:
    """The first paragraph of a section's class docstring, on one line ("" when it has none)."""
    cls = typing.get_type_hints(config_module.Config)[section]
    doc = inspect.getdoc(cls) or ""
    # a dataclass without a docstring gets a generated signature as its __doc__: not a description
    return "" if doc.startswith(cls.__name__ + "(") else " ".join(doc.split("\n\n")[0].split())


def format_sections(sections: Sequence[str], width: int = 120) -> str:
    """The keys of ``sections`` as a table, one block per section: ``key  type = default  doc``, long docs
    wrapped under the doc column."""
    blocks = []
    for s in sections:
        rows = describe_sections([s])
        kw = max(len(r.key) for r in rows)
        tw = max(len(r.type) for r in rows)
        dw = min(max(len(repr(r.default)) for r in rows), 22)
        lines = textwrap.wrap(f"{s}: {section_doc(s)}", width, subsequent_indent="  ")
        for r in rows:
            left = f"  {r.key:{kw}s}  {r.type:{tw}s} = {r.default!r:{dw}s}  "
            text = textwrap.wrap(
                r.doc, max(40, width - len(left)), break_on_hyphens=False, break_long_words=False
            ) or [""]
            lines.append(left + text[0])
            lines.extend(" " * len(left) + t for t in text[1:])
        blocks.append("\n".join(line.rstrip() for line in lines))
    return "\n\n".join(blocks)
