"""Function calling from local JSON / JSONL files, rewarded by structural match of the produced calls.

Row formats (one JSON object per line, or one JSON list of objects):

* xLAM / APIGen style: ``{"query": str, "tools": [schema, …], "answers": [{"name": str, "arguments": {…}}, …]}``;
  ``tools`` and ``answers`` may also be JSON-encoded strings (as in the published files).
* BFCL style: ``{"question": str | [[{"role": "user", "content": str}, …]], "function": [schema, …],
  "ground_truth": [{NAME: {ARG: [acceptable value, …]}}, …]}``; an acceptable value ``""`` marks an
  optional argument that may be left out (BFCL's convention).

Optional per row: ``"split": "train" | "test"`` (default: a hash of the question decides);
``"ordered": true`` — the calls must come in the listed order. By default several
expected calls are PARALLEL calls and match in any order (xLAM answers and BFCL's parallel categories).

The model answers with one ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` block per call
(the Hermes / Qwen format; the system prompt lists the tool schemas). Reward 1 when the produced calls
match the expected ones — same number of calls, same names, every argument present with an acceptable
value and no unexpected argument — else 0. Values compare structurally: numbers numerically (1 == 1.0,
booleans are not numbers), strings after strip + casefold (as BFCL standardises strings), lists in order,
objects by keys. ``score_calls`` also says why a completion failed: malformed / wrong_count / wrong_name
/ wrong_arguments.

The shipped ``data/fncall_sample.jsonl`` is a tiny file written for tests; real benchmark files are the
user's (``task.options.path``).
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

from gearlab.tasks.base import Problem, Task, read_utf8, sample_cycling
from gearlab.tasks.registry import register_task

__all__ = [
    "FunctionCallingTask",
    "load_fncall_rows",
    "load_fncall_sourced",
    "parse_calls",
    "score_calls",
    "SAMPLE_PATH",
    "MalformedCall"
]

SAMPLE_PATH = Path(__file__).parent / "data" / "fncall_sample.jsonl"
_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
OPTIONAL = ""  # BFCL: "" among the acceptable values = the argument may be omitted


class MalformedCall(ValueError):
    pass


def _maybe_json(v: Any, what: str, where: str) -> Any:
    if isinstance(v, str):
        try:
            return json.loads(v)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: {what} is a string but not valid JSON ({e.msg})") from None
    return v


def _row_to_problem(row: dict[str, Any], where: str) -> Problem:
    if "query" in row and "answers" in row:  # xLAM / APIGen
        query = row["query"]
        tools = _maybe_json(row.get("tools", []), "'tools'", where)
        answers = _maybe_json(row["answers"], "'answers'", where)
        if not isinstance(answers, list) or not all(
            isinstance(a, dict) and isinstance(a.get("name"), str) for a in answers
        ):
            raise ValueError(f"{where}: 'answers' must be a list of {{\"name\": …, \"arguments\": {{…}}}}")
        expected = [{"name": a["name"], "arguments": {k: [v] for k, v in _maybe_json(a.get("arguments", {}),
                    "'arguments'", where).items()}}
                    for a in answers]
    elif "question" in row and "ground_truth" in row:  # BFCL
        q = row["question"]
        while isinstance(q, list) and q and isinstance(q[0], list):
            q = q[0]
        query = q if isinstance(q, str) else " ".join(m.get("content", "") for m in q if m.get("role") == "user")
        tools = row.get("function", [])
        gt = row["ground_truth"]
        if not isinstance(gt, list) or not all(isinstance(c, dict) and len(c) == 1 for c in gt):
            raise ValueError(f"{where}: 'ground_truth' must be a list of {{NAME: {{ARG: [acceptable values]}}}}")
        expected = []
        for c in gt:
            (name, args), = c.items()
            expected.append(
                {"name": name, "arguments": {k: (v if isinstance(v, list) else [v]) for k, v in args.items()}}
            )
    else:
        raise ValueError(
            f"{where}: unknown row format: need 'query'+'answers' (xLAM) or 'question'+'ground_truth' (BFCL)"
        )
    if not isinstance(query, str) or not query.strip():
        raise ValueError(f"{where}: empty question")
    if not isinstance(tools, list):
        raise ValueError(f"{where}: the tool schemas must be a list")
    answer = json.dumps(
        [{"name": c["name"], "arguments": {k: v[0] for k, v in c["arguments"].items()}} for c in expected]
    )
    split = row.get("split")
    if split not in (None, "train", "test"):
        raise ValueError(f"{where}: 'split' must be 'train' or 'test', got {split!r}")
    return Problem(prompt=query, answer=answer, meta={"tools": tools, "expected": expected, "split": split,
                                                      "ordered": bool(row.get("ordered", False))})


def load_fncall_rows(path: str | Path) -> list[Problem]:
    """Problems from a JSON list or a JSONL file; a bad row raises ValueError naming file and line."""
    return [p for _, p in load_fncall_sourced(path)]


def load_fncall_sourced(path: str | Path) -> list[tuple[str, Problem]]:
    """``load_fncall_rows`` with where each problem came from: ``("FILE: line N" | "FILE: row N", problem)``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"function-calling data file not found: {path}")
    text = read_utf8(path)
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        rows = [(i + 1, r) for i, r in enumerate(data)]
        label = "row"
    else:
        rows = []
        for n, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    rows.append((n, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        label = "line"
    out = []
    for n, row in rows:
        if not isinstance(row, dict):
            raise ValueError(f"{path}: {label} {n}: not a JSON object")
        where = f"{path}: {label} {n}"
        out.append((where, _row_to_problem(row, where)))
    if not out:
        raise ValueError(f"{path}: no rows")
    return out


def parse_calls(completion: str) -> list[dict[str, Any]]:
    """The ``<tool_call>`` blocks of a completion as [{"name", "arguments"}]; MalformedCall if there is
    none or one is not a JSON object with a string "name" and an object "arguments" (a JSON-encoded
    object string is accepted, as some models emit it)."""
    blocks = _CALL_RE.findall(completion)
    if not blocks:
        raise MalformedCall("no <tool_call> block")
    calls = []
    for b in blocks:
        try:
            obj = json.loads(b)
        except json.JSONDecodeError as e:
            raise MalformedCall(f"tool call is not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise MalformedCall("tool call has no string 'name'")
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise MalformedCall("tool call 'arguments' is a string but not JSON") from None
        if not isinstance(args, dict):
            raise MalformedCall("tool call 'arguments' is not an object")
        calls.append({"name": obj["name"], "arguments": args})
    return calls


def _same(a: Any, b: Any) -> bool:
    num = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
    if num(a) and num(b):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, str) and isinstance(b, str):
        return a.strip().casefold() == b.strip().casefold()
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _call_ok(got: dict[str, Any], exp: dict[str, Any]) -> bool:
    if got["name"] != exp["name"]:
        return False
    ga, ea = got["arguments"], exp["arguments"]
    if any(k not in ea for k in ga):
        return False
    for k, acceptable in ea.items():
        if k not in ga:
            if OPTIONAL not in acceptable:
                return False
        elif not any(_same(ga[k], v) for v in acceptable if not (v == OPTIONAL and isinstance(v, str))):
            return False
    return True


def _match_any_order(got: list[dict], exp: list[dict]) -> bool:
    if not exp:
        return True
    first = exp[0]
    return any(_call_ok(g, first) and _match_any_order(got[:i] + got[i + 1:], exp[1:]) for i, g in enumerate(got))


def score_calls(completion: str, expected: list[dict[str, Any]], ordered: bool = False) -> tuple[float, str]:
    """(reward, reason): (1.0, "ok") on a structural match, else 0.0 and one of "malformed",
    "wrong_count", "wrong_name", "wrong_arguments"."""
    try:
        got = parse_calls(completion)
    except MalformedCall:
        return 0.0, "malformed"
    if len(got) != len(expected):
        return 0.0, "wrong_count"
    names_g, names_e = [g["name"] for g in got], [e["name"] for e in expected]
    if (names_g != names_e) if ordered else (sorted(names_g) != sorted(names_e)):
        return 0.0, "wrong_name"
    ok = all(_call_ok(g, e) for g, e in zip(got, expected)) if ordered else _match_any_order(got, expected)
    return (1.0, "ok") if ok else (0.0, "wrong_arguments")


@register_task("fncall")
class FunctionCallingTask(Task):
    """Single-turn function calling from a local file (default: the shipped tiny sample).

    Args:
        path:          JSON / JSONL file (formats in the module docstring); None = the sample
        test_fraction: share of rows held out, by a hash of the question (seed-free, disjoint splits)
    """

    name = "fncall"

    def __init__(self, path: str | None = None, test_fraction: float = 0.2, seed: int = 0) -> None:
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        self.path = Path(path).expanduser() if path else SAMPLE_PATH
        self.sourced = load_fncall_sourced(self.path)
        self.rows = [p for _, p in self.sourced]
        self.test_fraction, self.seed = test_fraction, seed

    def sourced_problems(self) -> list[tuple[str, Problem]]:
        return list(self.sourced)

    def _split(self, p: Problem) -> str:
        if p.meta.get("split"):
            return p.meta["split"]
        h = int.from_bytes(hashlib.sha256(p.prompt.encode()).digest()[:8], "big")
        return "test" if h / 2**64 < self.test_fraction else "train"

    def problems(self, split: str, n: int, seed: int | None = None) -> list[Problem]:
        """`n` rows of `split`, shuffled by `seed`; repeated (reshuffled) when the split has fewer rows."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        pool = [p for p in self.rows if self._split(p) == split]
        if not pool:
            raise ValueError(f"{self.path}: no rows fall in the {split!r} split ({len(self.rows)} rows, test_fraction "
                             f"{self.test_fraction})")
        return sample_cycling(pool, n, f"fncall/{split}/{self.seed if seed is None else seed}")

    def messages(self, problem: Problem, privileged: bool | str = False) -> list[dict[str, str]]:
        tools = "\n".join(json.dumps(t, sort_keys=True) for t in problem.meta["tools"])
        system = ("You can call these functions:\n<tools>\n" + tools + "\n</tools>\nFor each call, answer with "
                  '<tool_call>{"name": NAME, "arguments": {ARGUMENTS}}</tool_call>.')
        user = problem.prompt + (f"\n(Reference answer: {problem.answer})" if privileged else "")
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def extract_answer(self, completion: str) -> str | None:
        try:
            return json.dumps(parse_calls(completion), sort_keys=True)
        except MalformedCall:
            return None

    def reward(self, problem: Problem, completion: str) -> float:
        return score_calls(completion, problem.meta["expected"], problem.meta["ordered"])[0]

    def __repr__(self) -> str:
        return f"FunctionCallingTask(path={str(self.path)!r}, rows={len(self.rows)})"
