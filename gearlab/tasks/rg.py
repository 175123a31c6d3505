"""reasoning-gym's procedural reasoning tasks as one gearlab task family: ``task=rg task.options.dataset=<name>``.

reasoning-gym (PyPI ``reasoning-gym``) generates problems offline, each dataset with its own verifier. Here:

* **Problems.** Entry i of a dataset with seed s is generated from s + i (reasoning-gym's own convention). A
  problem belongs to the test split when a hash of its dataset name and question falls in the first
  ``test_fraction`` of the hash range, else to train: the splits never share a question, whatever ``n`` and the
  seed. ``problems(split, n, seed)`` walks the dataset's stream (seeded by the split and ``seed``) and keeps the
  entries of its split until it has ``n``.
* **Mixtures.** ``dataset`` is a name or a mapping ``{name: weight}``; each problem's dataset is drawn by weight
  from a seeded stream, then takes the next entry of that dataset's stream.
* **Options.** ``config`` holds the dataset's own options (``{option: value}``; for a mixture
  ``{name: {option: value}}``), passed through to reasoning-gym (difficulty, sizes, operators …). An unknown
  dataset or option, or a value the dataset rejects, is a one-line error naming the key.
* **Prompt and answer.** The user message is the dataset's question; ``system_prompt`` is one of reasoning-gym's
  named system prompts (``default``, ``simple``, ``direct``, ``DeepSeekZero``, ``chain_of_draft``), ``none`` (no
  system turn) or literal text. The answer is the content of the LAST ``<answer>…</answer>`` of the completion.
* **Reward.** The dataset's own ``score_answer(answer, entry)``, a float in [0, 1] (some datasets give partial
  credit; an answer scores as correct at 1). No answer tag: 0.
* **Demonstrations.** Where an entry carries a worked solution (``metadata["answer_cot"]``, e.g. ``gsm_symbolic``),
  ``Problem.solution`` is that solution followed by the answer line. The arithmetic datasets (``chain_sum``,
  ``basic_arithmetic``, ``products``) ship none; their solution is computed from the expression, one
  ``a op b = c`` line per operation (``gearlab.tasks.rg_steps``). Elsewhere it is just the answer line. The warm
  start imitates them.
* **Located errors** (``gearlab credit-eval``): ``gsm_symbolic`` and the arithmetic datasets listed in
  ``gearlab.tasks.rg_errors.SUPPORTED``; None elsewhere.
"""
from __future__ import annotations

import hashlib
import random
from typing import Any, Mapping

from gearlab.errors import ConfigError
from gearlab.tasks.base import Problem, Task
from gearlab.tasks.registry import register_task
from gearlab.tasks.rg_steps import worked_solution

__all__ = ["ReasoningGymTask", "answer_line", "extract_tagged_answer"]

_MAX_DRAWS_PER_PROBLEM = 50  # a dataset whose split yields fewer distinct entries than this is refused


def extract_tagged_answer(completion: str) -> str | None:
    """The stripped content of the last ``<answer>…</answer>`` of `completion`, or None."""
    start = completion.rfind("<answer>")
    while start != -1:
        end = completion.find("</answer>", start)
        if end != -1:
            return completion[start + len("<answer>"):end].strip()
        start = completion.rfind("<answer>", 0, start)
    return None


def answer_line(answer: str) -> str:
    """The final line a demonstration ends with."""
    return f"<answer>{answer}</answer>"


def _registry() -> dict[str, Any]:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        raise ConfigError("key 'task.name': task rg needs reasoning-gym: pip install reasoning-gym") from e
    return DATASETS


def _mixture(dataset: str | Mapping[str, float], config: Mapping[str, Any] | None) -> dict[str, tuple[float, dict]]:
    """{dataset name: (weight, its options)} from the task options; one-line ConfigErrors naming the key."""
    known = _registry()
    weights = {dataset: 1.0} if isinstance(dataset, str) else {str(k): float(v) for k, v in dict(dataset).items()}
    if not weights or any(w <= 0 for w in weights.values()):
        raise ConfigError(f"key 'task.options.dataset': needs a dataset name or positive weights, got {dataset!r}")
    for name in weights:
        if name not in known:
            close = sorted(n for n in known if n[:3] == name[:3])[:5]
            raise ConfigError(f"key 'task.options.dataset': unknown reasoning-gym dataset {name!r}"
                              f"{f' (did you mean: {close})' if close else ''}; gearlab tasks lists all")
    config = dict(config or {})
    if isinstance(dataset, str):
        per = {dataset: config}
    else:
        stray = sorted(set(config) - set(weights))
        if stray:
            raise ConfigError(f"key 'task.options.config': {stray[0]!r} is not a dataset of the mixture "
                              f"{sorted(weights)}")
        per = {n: dict(config.get(n) or {}) for n in weights}
    return {n: (weights[n], per[n]) for n in weights}


def _build(name: str, options: dict, seed: int, size: int = 64) -> Any:
    """The reasoning-gym dataset ``name`` with ``options``, ``seed`` and ``size`` entries; bad options are one-line
    ConfigErrors. (Some datasets precompute per entry at construction, e.g. gsm_symbolic's choice of template: the
    size is what will be read, not a bound.)"""
    import dataclasses

    cls, config_cls = _registry()[name]
    fields = {f.name for f in dataclasses.fields(config_cls)} - {"seed", "size"}
    for k in options:
        if k not in fields:
            raise ConfigError(f"key 'task.options.config': reasoning-gym dataset {name!r} has no option {k!r} "
                              f"(its options: {', '.join(sorted(fields))})")
    try:
        config = config_cls(**options, seed=seed, size=size)
        if hasattr(config, "validate"):
            config.validate()
        return cls(config=config)
    except (AssertionError, TypeError, ValueError) as e:
        raise ConfigError(f"key 'task.options.config': reasoning-gym dataset {name!r} rejects {options}: {e}") from None


def _system_prompt(choice: str | None) -> str | None:
    if choice is None or choice == "none":
        return None
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS.get(choice, choice)


class _Stream:
    """Entries 0, 1, 2, … of one dataset and seed. Entry i does not depend on the dataset's size (reasoning-gym
    seeds entry i with seed + i, and draws per-entry precomputations in order), so the stream grows by rebuilding the
    dataset at twice the size when it runs out."""

    def __init__(self, name: str, options: dict, seed: int, size: int) -> None:
        self.name, self.options, self.seed = name, options, seed
        self.dataset, self.i = _build(name, options, seed, max(64, size)), 0

    def next(self) -> dict[str, Any]:
        if self.i >= self.dataset.size:
            self.dataset = _build(self.name, self.options, self.seed, 2 * self.dataset.size)
        self.i += 1
        return self.dataset[self.i - 1]


@register_task("rg", dataset="gsm_symbolic")
class ReasoningGymTask(Task):
    """A reasoning-gym dataset, or a weighted mixture of them (see the module docstring)."""

    def __init__(self, dataset: str | Mapping[str, float] = "gsm_symbolic", config: Mapping[str, Any] | None = None,
                 system_prompt: str | None = "simple", test_fraction: float = 0.1) -> None:
        if not 0 < test_fraction < 1:
            raise ConfigError(f"key 'task.options.test_fraction': must be in (0, 1), got {test_fraction}")
        self.mixture = _mixture(dataset, config)
        self.test_fraction = test_fraction
        self.system_prompt = _system_prompt(system_prompt)
        for name, (_, options) in self.mixture.items():
            _build(name, options, 0)  # every option checked now, before any work
        self._scorers: dict[str, Any] = {}

    # -- problems ---------------------------------------------------------------------------------
    def _split_of(self, name: str, question: str) -> str:
        h = int.from_bytes(hashlib.sha256(f"{name}\0{question}".encode()).digest()[:8], "big")
        return "test" if h < self.test_fraction * 2**64 else "train"

    def problems(self, split: str, n: int, seed: int = 0) -> list[Problem]:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        names = sorted(self.mixture)
        base = int.from_bytes(hashlib.sha256(f"rg\0{split}\0{seed}".encode()).digest()[:4], "big")
        share = self.test_fraction if split == "test" else 1 - self.test_fraction
        streams = {nm: _Stream(nm, self.mixture[nm][1], base + k * 1_000_003, int(1.5 * (n + 8) / share))
                   for k, nm in enumerate(names)}
        pick = random.Random(base)
        weights = [self.mixture[nm][0] for nm in names]
        out: list[Problem] = []
        draws = 0
        while len(out) < n:
            nm = names[0] if len(names) == 1 else pick.choices(names, weights)[0]
            entry = streams[nm].next()
            draws += 1
            if self._split_of(nm, entry["question"]) == split:
                out.append(self._problem(nm, entry))
            elif draws > _MAX_DRAWS_PER_PROBLEM * (n + 10):
                raise ConfigError(f"key 'task.options.dataset': {names} gave {len(out)} {split} problems in {draws} "
                                  f"draws, fewer than the {n} asked (too few distinct problems at these settings)")
        return out

    @staticmethod
    def _problem(name: str, entry: dict[str, Any]) -> Problem:
        answer = str(entry["answer"])
        cot = (entry.get("metadata") or {}).get("answer_cot")
        if not cot:  # the arithmetic datasets ship none: gearlab writes one line per operation
            cot = "\n".join(worked_solution(name, entry) or [])
        solution = f"{cot.rstrip()}\n{answer_line(answer)}" if cot else answer_line(answer)
        return Problem(prompt=str(entry["question"]), answer=answer, solution=solution,
                       meta={"dataset": name, "entry": entry})

    # -- verification -----------------------------------------------------------------------------
    def extract_answer(self, completion: str) -> str | None:
        return extract_tagged_answer(completion)

    def reward(self, problem: Problem, completion: str) -> float:
        """The dataset's own score of the tagged answer, in [0, 1]; 0 without one. Never raises."""
        try:
            got = extract_tagged_answer(completion)
            if got is None:
                return 0.0
            name = problem.meta["dataset"]
            if name not in self._scorers:
                from reasoning_gym import get_score_answer_fn

                self._scorers[name] = get_score_answer_fn(name)
            return float(min(1.0, max(0.0, self._scorers[name](got, problem.meta["entry"]))))
        except Exception:  # a verifier must not crash a rollout on odd text
            return 0.0

    def locate_error(self, problem: Problem, completion: str) -> tuple[int, int] | None:
        """The first wrong computation line, or the answer tag after a correct chain (``gearlab.tasks.rg_errors``);
        None for a correct completion and for datasets without a checker."""
        try:
            from gearlab.tasks import rg_errors

            name, entry = problem.meta["dataset"], problem.meta["entry"]
            correct = self.reward(problem, completion) >= 1.0  # the task's own reading of the answer decides
            if name == "gsm_symbolic":
                return rg_errors.locate_gsm_error(entry, completion, correct=correct)
            if name in rg_errors.SUPPORTED:
                return rg_errors.locate_arith_error(name, entry, completion, correct=correct)
        except Exception:  # never raise on odd text
            return None
        return None
