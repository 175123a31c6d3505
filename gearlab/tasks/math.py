r"""Maths benchmarks (GSM8K, MATH / MATH-500, AIME-style) from local files, scored with math-verify.

Row formats, detected per row (keys compared case-insensitively, so ``"Problem"``/``"Answer"`` work too):

* GSM8K: ``{"question", "answer"}``, the answer a worked solution ending ``#### 42``: answer = the text after
  the last ``####`` less thousands separators; solution = the text before it less ``<<48/2=24>>`` annotations.
* MATH / MATH-500: ``{"problem", "solution"[, "answer", "level", "type" | "subject", "unique_id"]}``:
  answer = the ``"answer"`` field, else the content of the last ``\boxed{...}`` of the solution.
* AIME-style: ``{"problem" | "question", "answer"[, "id", "year"]}``; the answer may be an int.
* generic: ``{"prompt", "answer"[, "solution"]}``.

Other keys go to ``Problem.meta``, plus ``"format"`` (gsm8k / math / aime / prompt) and ``"problem"`` (the
raw question text). Optional per row: ``"split": "train" | "test"`` overrides the hash split.
Files: ``.jsonl`` (one object a line), ``.json`` (a list of objects; JSON lines are accepted too) and
``.parquet``. ``Problem.prompt`` is ``prompt_template`` with ``{problem}`` replaced by the question: a
plain substitution, not ``str.format``, so literal braces such as ``\boxed{}`` stay as written. The
default template asks the model to box its final answer; the reward prefers the last ``\boxed{}``.

The shipped ``data/*_sample.jsonl`` are tiny files (6-8 rows) written for tests. ``task.options.path`` is required:
without it the task refuses to start rather than train on a sample; ``task.options.path=sample`` asks for the
sample explicitly (a smoke test).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import re
import threading
from math import isnan
from pathlib import Path
from typing import Any

from gearlab.errors import ConfigError
from gearlab.tasks.base import Problem, Task, read_utf8, sample_cycling
from gearlab.tasks.registry import register_task

__all__ = [
    "SAMPLES", "MathTask", "last_boxed", "load_math_problems", "load_math_sourced", "math_reward", "row_to_problem"
]

DATA_DIR = Path(__file__).parent / "data"
SAMPLES = {k: DATA_DIR / f"{k}_sample.jsonl" for k in ("gsm8k", "math500", "aime")}
DEFAULT_TEMPLATE = "{problem}\nPut the final answer in \\boxed{}."
TIMEOUT_S = 5  # math-verify's parse / verify timeouts, main thread only (see math_reward)

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\b")
_CALC_RE = re.compile(r"<<[^<>]*>>")
_HUB_ID_RE = re.compile(r"^[\w.-]+/[\w.-]+$")
_TEXT_KEYS = ("problem", "question", "prompt", "answer", "solution", "split")


def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError as e:  # a config error, not a bad completion: say so loudly
        raise ImportError("the maths tasks need math-verify: pip install math-verify") from e
    return math_verify


def last_boxed(text: str | None) -> str | None:
    r"""The content of the last ``\boxed{...}`` (or ``\fbox{...}``) of `text`, braces balanced (escaped
    ``\{`` / ``\}`` do not count), or the token of ``\boxed 5``; None when there is none or it is unclosed."""
    if not text:
        return None
    matches = list(_BOXED_RE.finditer(text))
    if not matches:
        return None
    i = matches[-1].end()
    if text[i:i + 1] != "{":
        m = re.match(r"[ \t]+([^\s$]+)", text[i:])
        return m.group(1).rstrip(".") if m else None
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
        j += 1
    return None


def _clean(ans: str) -> str:
    """Strip whitespace, enclosing ``$...$`` and a trailing period."""
    ans = ans.strip()
    while len(ans) >= 2 and ans.startswith("$") and ans.endswith("$"):
        ans = ans[1:-1].strip()
    return ans.rstrip(".").strip()


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout: bool) -> tuple[Any, ...]:
    mv = _math_verify()
    t = TIMEOUT_S if timeout else None
    text = gold if gold.startswith("$") or "\\boxed" in gold else f"${gold}$"  # bare gold may not parse as LaTeX
    out = mv.parse(text, extraction_config=[mv.LatexExtractionConfig()], parsing_timeout=t)
    if not out:  # plain numbers / expressions
        out = mv.parse(gold, extraction_config=[mv.ExprExtractionConfig()], parsing_timeout=t)
    return tuple(out)


def math_reward(completion: str | None, gold: str) -> float:
    r"""1.0 if the final answer of `completion` equals `gold` by math-verify, else 0.0.

    The final answer is the content of the LAST ``\boxed{}`` (math-verify alone would merge all boxes
    into a set); without a box math-verify extracts an answer from the whole text (e.g. "the answer is 7").
    The gold is parsed as LaTeX (wrapped in ``$...$``) and, failing that, as a plain expression.
    Never raises on any text (errors and timeouts score 0.0); only a missing math-verify raises ImportError.

    Threads: math-verify times out with ``signal.alarm``, which works only in the main thread; from any
    other thread the timeouts are disabled (``parsing_timeout=None`` / ``timeout_seconds=None``), so a
    pathological expression there can take long: bound it yourself (e.g. a process pool).
    """
    mv = _math_verify()
    if not completion or not isinstance(completion, str) or gold is None:
        return 0.0
    main = threading.current_thread() is threading.main_thread()
    t = TIMEOUT_S if main else None
    try:
        g = _parse_gold(_clean(str(gold)), main)
        box = last_boxed(completion)
        pred = mv.parse("\\boxed{" + box + "}" if box is not None else completion, parsing_timeout=t)
        if not g or not pred:
            return 0.0
        return 1.0 if mv.verify(list(g), pred, timeout_seconds=t) else 0.0
    except Exception:  # a verifier must not crash a rollout on odd text
        return 0.0


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and isnan(v)) or (isinstance(v, str) and not v.strip())


def _as_text(v: Any) -> str:
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):  # numpy scalars from parquet
        v = v.item()
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return str(v).strip()


def row_to_problem(row: dict[str, Any], where: str, template: str = DEFAULT_TEMPLATE) -> Problem:
    """One row of any supported format as a Problem; ValueError naming `where` and the keys otherwise."""
    low = {str(k).lower(): v for k, v in row.items()}

    def get(key: str) -> Any:
        return None if _missing(low.get(key)) else low[key]

    question, answer, solution = get("question"), get("answer"), get("solution")
    if question is not None and isinstance(answer, str) and "####" in answer:
        fmt, text = "gsm8k", question
        before, _, after = answer.rpartition("####")
        answer, solution = after.strip().replace(",", ""), _CALC_RE.sub("", before).strip()
    elif get("problem") is not None and solution is not None:
        fmt, text = "math", get("problem")
        if answer is None:
            answer = last_boxed(str(solution))
            if answer is None:
                raise ValueError(f"{where}: no 'answer' and no \\boxed{{...}} in the solution")
    elif (get("problem") is not None or question is not None) and answer is not None:
        fmt, text = "aime", get("problem") if get("problem") is not None else question
    elif get("prompt") is not None and answer is not None:
        fmt, text = "prompt", get("prompt")
    else:
        raise ValueError(f"{where}: unknown row format (keys: {sorted(map(str, row))}); expected GSM8K "
                         "question+answer ('... #### N'), MATH problem+solution[+answer], AIME "
                         "problem|question+answer, or prompt+answer")
    text, answer = _as_text(text), _clean(_as_text(answer))
    if not answer:
        raise ValueError(f"{where}: empty answer")
    split = None if _missing(low.get("split")) else low["split"]
    if split not in (None, "train", "test"):
        raise ValueError(f"{where}: 'split' must be 'train' or 'test', got {split!r}")
    meta = {k: v for k, v in row.items() if str(k).lower() not in _TEXT_KEYS}
    meta.update(format=fmt, problem=text, split=split)
    return Problem(prompt=template.replace("{problem}", text), answer=answer,
                   solution="" if solution is None else _as_text(solution), meta=meta)


def _read_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(where, row) pairs of a .parquet, JSON-list or JSON-lines file; where = "FILE: row|line N"."""
    if path.suffix == ".parquet":
        import pandas as pd
        rows, label = list(enumerate(pd.read_parquet(path).to_dict("records"), start=1)), "row"
    else:
        text = read_utf8(path)
        if text.lstrip().startswith("["):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
            rows, label = list(enumerate(data, start=1)), "row"
        else:
            rows, label = [], "line"
            for n, line in enumerate(text.splitlines(), start=1):
                if line.strip():
                    try:
                        rows.append((n, json.loads(line)))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}: line {n}: not valid JSON ({e.msg})") from None
    out = []
    for n, row in rows:
        if not isinstance(row, dict):
            raise ValueError(f"{path}: {label} {n}: not a JSON object")
        out.append((f"{path}: {label} {n}", row))
    return out


def _has_datasets() -> bool:  # a function so tests can fake it
    return importlib.util.find_spec("datasets") is not None


def _load_hub(repo_id: str, config: str | None, template: str) -> list[tuple[str, Problem]]:
    """All splits of a hub dataset (needs `datasets` and network); when it has both a "train" and a
    "test" split they are kept, else the hash split decides."""
    import datasets
    dsd = datasets.load_dataset(repo_id, config)
    both = "train" in dsd and "test" in dsd
    out = []
    for split, ds in dsd.items():
        for i, row in enumerate(ds, start=1):
            row = dict(row)
            if both and split in ("train", "test"):
                row.setdefault("split", split)
            where = f"{repo_id}[{split}]: row {i}"
            out.append((where, row_to_problem(row, where, template)))
    return out


def load_math_problems(path: str | Path, template: str = DEFAULT_TEMPLATE, hub_config: str | None = None
                       ) -> list[Problem]:
    """Problems of a local file (or, when `path` is not a file but looks like a hub id such as
    "openai/gsm8k" and `datasets` is installed, of that hub dataset). FileNotFoundError with the path
    when there is neither; ValueError naming the file and row/line for a bad row or an empty file."""
    return [prob for _, prob in load_math_sourced(path, template, hub_config)]


def load_math_sourced(path: str | Path, template: str = DEFAULT_TEMPLATE, hub_config: str | None = None
                      ) -> list[tuple[str, Problem]]:
    """``load_math_problems`` with where each problem came from: ``("FILE: line N" | "FILE: row N", problem)``."""
    p = Path(path).expanduser()
    if not p.is_file():
        if (_HUB_ID_RE.match(str(path)) and p.suffix not in (".jsonl", ".json", ".parquet")
                and _has_datasets()):
            return _load_hub(str(path), hub_config, template)
        raise FileNotFoundError(f"maths data file not found: {p}")
    out = [(where, row_to_problem(row, where, template)) for where, row in _read_rows(p)]
    if not out:
        raise ValueError(f"{p}: no rows")
    return out


@register_task("aime", sample="aime")
@register_task("math500", sample="math500")
@register_task("math", sample="math500")
@register_task("gsm8k", sample="gsm8k")
class MathTask(Task):
    r"""Maths word problems / competition problems, reward = math-verify equivalence of the last box.

    Args:
        path:            data file (formats in the module docstring) or a hub id; required. ``"sample"`` = the
                         shipped test sample `sample` (6-8 rows), chosen explicitly
        test_path:       optional held-out file: then every row of `path` is train and every row of
                         `test_path` is test (`split` fields and `test_fraction` are ignored)
        test_fraction:   without test_path: share of rows held out by a hash of the question (seed-free)
        prompt_template: the user prompt; ``{problem}`` is replaced by the question (no str.format);
                         default ``"{problem}\nPut the final answer in \boxed{}."``
        seed:            default shuffle seed of `problems`
        sample:          which shipped sample path="sample" means (gsm8k / math500 / aime; set per task name)
        hub_config:      config name when `path` is a hub id (e.g. "main" for openai/gsm8k)
    Train and test never share a question: train drops any question that is also a test question.
    """

    name = "math"

    def __init__(self, path: str | None = None, test_path: str | None = None, test_fraction: float = 0.2,
                 prompt_template: str = DEFAULT_TEMPLATE, seed: int = 0, sample: str = "math500",
                 hub_config: str | None = None) -> None:
        _math_verify()  # fail at construction, not at the first reward
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        if "{problem}" not in prompt_template:
            raise ValueError(f"prompt_template must contain '{{problem}}', got {prompt_template!r}")
        if sample not in SAMPLES:
            raise ValueError(f"unknown sample {sample!r}; known: {sorted(SAMPLES)}")
        if not path:  # a test sample trained on silently looks like a run on the benchmark: refuse instead
            rows = sum(1 for line in SAMPLES[sample].read_text().splitlines() if line.strip())
            raise ConfigError(f"key 'task.options.path': no data file given; set task.options.path=FILE (JSONL, JSON "
                              f"or parquet, or a hub id), or task.options.path=sample to use the {rows}-row test "
                              "sample "
                              f"gearlab/tasks/data/{SAMPLES[sample].name}")
        self.path = str(SAMPLES[sample]) if str(path) == "sample" else str(path)
        self.test_path, self.test_fraction, self.seed = test_path, test_fraction, seed
        self.prompt_template = prompt_template
        self.sourced = load_math_sourced(self.path, prompt_template, hub_config)
        rows = [p for _, p in self.sourced]
        if test_path:
            test_sourced = load_math_sourced(test_path, prompt_template, hub_config)
            self.sourced = self.sourced + test_sourced
            train, test = rows, [p for _, p in test_sourced]
        else:
            train = [p for p in rows if self._split(p) == "train"]
            test = [p for p in rows if self._split(p) == "test"]
        held_out = {p.meta["problem"] for p in test}
        self.pools = {"train": [p for p in train if p.meta["problem"] not in held_out], "test": test}

    def sourced_problems(self) -> list[tuple[str, Problem]]:
        return list(self.sourced)

    def _split(self, p: Problem) -> str:
        if p.meta.get("split"):
            return p.meta["split"]
        h = int.from_bytes(hashlib.sha256(p.meta["problem"].encode()).digest()[:8], "big")
        return "test" if h / 2**64 < self.test_fraction else "train"

    def problems(self, split: str, n: int, seed: int | None = None) -> list[Problem]:
        """`n` problems of `split`, shuffled by `seed`; repeated (reshuffled) when the split has fewer."""
        if split not in self.pools:
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        pool = self.pools[split]
        if not pool:
            raise ValueError(f"{self.test_path if split == 'test' and self.test_path else self.path}: no rows "
                             f"fall in the {split!r} split (test_fraction {self.test_fraction})")
        return sample_cycling(pool, n, f"{self.name}/{split}/{self.seed if seed is None else seed}")

    def extract_answer(self, completion: str) -> str | None:
        r"""The content of the last ``\boxed{}``, stripped of whitespace, ``$`` and a final period; or None."""
        box = last_boxed(completion)
        return None if box is None else (_clean(box) or None)

    def reward(self, problem: Problem, completion: str) -> float:
        return math_reward(completion, problem.answer)

    def __repr__(self) -> str:
        return (f"MathTask(name={self.name!r}, path={self.path!r}, train={len(self.pools['train'])}, "
                f"test={len(self.pools['test'])})")
