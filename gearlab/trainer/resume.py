"""What running a training command again may do to its run folder: resume it, extend it, or nothing at all.

A run folder (``<trainer.output_dir>/<run name>``) keeps the configuration the run was started with
(``config.yaml``, the same as its MLflow params) and, once the run has finished, ``summary.json``. With
``trainer.resume=auto`` (the default), a command naming an existing run folder is checked against it before any
work:

* **same configuration, run finished** — nothing to do: the command says so and changes nothing (exit 0). To train
  further, raise ``trainer.max_steps``.
* **same configuration, run not finished** — it resumes from its last checkpoint, exactly.
* **trainer.max_steps raised** — the run is extended: the extra iterations are trained from the last checkpoint,
  in the same MLflow run, and ``config.yaml`` then records the new ``trainer.max_steps`` (the MLflow param keeps
  the value the run started with; the run's tag ``max_steps_history`` says ``3 -> 5``). A learning-rate schedule
  or an assigner schedule over ``trainer.max_steps`` spans the new total from there on. Lowering it is refused.
* **any other key different** — refused with one line naming the keys (exit 2), nothing written: resuming would
  train one run with two configurations, against a record (``config.yaml``, MLflow params) that names one. Start
  another run with ``trainer.run_name=NAME`` instead.

Keys free to differ (:data:`FREE_ON_RESUME`) say how this process runs, not what is trained:

* run control: ``trainer.progress_bar``, ``trainer.threads``, ``trainer.deadline``, ``trainer.stop_after``,
  ``trainer.log_every``, ``trainer.checkpoint_every``, ``trainer.eval_every`` (extra held-out evaluations, with
  seeds of their own), ``trainer.max_nonfinite``, ``trainer.no_signal_patience`` (a warning's threshold),
  ``task.max_prompt_tokens`` (a check when the data loads, which changes no prompt), ``trainer.resume``;
* where the folder is: ``trainer.output_dir``, ``trainer.run_name`` (they led here);
* memory layout, the same gradient by design: ``algorithm.micro_batch_size``, ``algorithm.micro_batch_tokens``,
  ``signals.chunk_size``, ``trainer.activation_checkpointing``;
* other commands' settings: ``warmstart.*``, ``export.*``, ``inspect.*``, ``replay.*``, ``compare.*``,
  ``credit_eval.*``, ``eval.checkpoint``, ``eval.cache_start``.

``rollout.engine=auto`` and ``rollout.fast.attention=auto`` (:data:`RESOLVED`) are compared after they are resolved
(the saved values are the engine and the decode kernel the run used): a run saved with ``sdpa`` resumes under
``auto`` where ``auto`` is ``sdpa`` (off CUDA), and is refused where it is ``split``. A key the saved file lacks
(added to gearlab since) counts as equal when this command leaves it at its default. Other ``trainer.resume``
values (``never``, a checkpoint path) are deliberate restarts or forks: not checked.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from gearlab.config import Config, ConfigError, flatten

FREE_ON_RESUME = frozenset({
    "trainer.progress_bar", "trainer.threads", "trainer.deadline", "trainer.stop_after", "trainer.log_every",
    "trainer.checkpoint_every", "trainer.eval_every", "trainer.max_nonfinite", "trainer.no_signal_patience",
    "task.max_prompt_tokens", "trainer.resume",
    "trainer.output_dir", "trainer.run_name",
    "algorithm.micro_batch_size", "algorithm.micro_batch_tokens", "signals.chunk_size",
    "trainer.activation_checkpointing", "trainer.deterministic",
    "eval.checkpoint", "eval.cache_start",
})
FREE_SECTIONS = ("warmstart.", "export.", "inspect.", "replay.", "compare.", "credit_eval.")
SHOWN = 6  # differing keys named in the one-line error; the rest are counted
RESOLVED = ("rollout.engine", "rollout.fast.attention")  # whose auto depends on the machine: compared once resolved


@dataclass
class RunState:
    """What a run folder holds, as far as re-running a command on it is concerned."""

    saved: dict[str, Any] = field(default_factory=dict)  # flattened saved config ({} = a new run)
    summary: dict[str, Any] | None = None  # summary.json of a finished run (None: not finished)
    iterations_done: int = 0  # by the finished run (0 when not finished)

    @property
    def exists(self) -> bool:
        return bool(self.saved)

    @property
    def saved_max_steps(self) -> int:
        return int(self.saved.get("trainer.max_steps", 0))

    def extends(self, cfg: Config) -> bool:
        """This command raises the saved trainer.max_steps."""
        return self.exists and cfg.trainer.max_steps > self.saved_max_steps

    def finished_for(self, cfg: Config) -> bool:
        """Nothing left to train: the run finished at least ``cfg.trainer.max_steps`` iterations."""
        return self.summary is not None and self.iterations_done >= cfg.trainer.max_steps


def _free(key: str) -> bool:
    return key in FREE_ON_RESUME or key.startswith(FREE_SECTIONS)


def _open_dict(cfg: Config, path: str) -> bool:
    """``path`` names a free-form dict of ``cfg`` (its entries are data), not a schema section (whose keys are \
fields)."""
    node = OmegaConf.select(cfg, path) if path else None
    return isinstance(node, DictConfig) and OmegaConf.get_type(node) is dict


def _defaults() -> dict[str, Any]:
    return flatten(OmegaConf.structured(Config))


def read_state(rdir: Path) -> RunState:
    """The saved config (``config.yaml``) and, for a finished run, its summary. ``summary.json`` records
    ``iterations_done`` (one written before it did: the saved ``trainer.max_steps``)."""
    path = rdir / "config.yaml"
    if not path.is_file():
        return RunState()
    saved = flatten(OmegaConf.load(path))
    state = RunState(saved=saved)
    spath = rdir / "summary.json"
    if spath.is_file():
        try:
            summary = json.loads(spath.read_text())
        except ValueError:
            return state  # a summary cut short: the run did not get to finish writing it
        state.summary = summary
        state.iterations_done = int(summary.get("iterations_done", state.saved_max_steps))
    return state


def check_resume(cfg: Config, rdir: Path) -> RunState:
    """Check ``cfg`` against the run folder ``rdir`` it names (module docstring); ConfigError, one line naming every
    differing key, when it may not resume there. Reads only. Returns the folder's state (empty for a new run)."""
    if cfg.trainer.resume != "auto":
        return RunState()
    state = read_state(rdir)
    if not state.exists:
        return state
    now, defaults = flatten(cfg), _defaults()
    diffs = []
    for key, value in now.items():
        if _free(key) or key == "trainer.max_steps":
            continue
        if key in RESOLVED and value == "auto":
            continue  # compared once resolved (check_resolved)
        before = state.saved.get(key, defaults.get(key))
        if before != value:
            diffs.append(f"{key} (saved {_show(before)}, now {_show(value)})")
    for key, before in state.saved.items():  # an entry of an open dict (assigner.options, logging.tags) dropped since
        parent = key.rpartition(".")[0]
        if key not in now and not _free(key) and _open_dict(cfg, parent):
            diffs.append(f"{key} (saved {_show(before)}, now unset)")
    if cfg.trainer.max_steps < state.saved_max_steps:
        diffs.append(
            f"trainer.max_steps (saved {state.saved_max_steps}, now {cfg.trainer.max_steps}: it can only be raised)"
        )
    if diffs:
        more = f" and {len(diffs) - SHOWN} more" if len(diffs) > SHOWN else ""
        raise ConfigError(f"run folder {rdir} was started with another configuration: "
                          f"{', '.join(diffs[:SHOWN])}{more}; "
                          f"resume it with its saved values ({rdir / 'config.yaml'}), or start another run with "
                          f"trainer.run_name=NAME")
    return state


def check_resolved(cfg: Config, state: RunState, rdir: Path) -> None:
    """The keys of :data:`RESOLVED`, once ``cfg``'s ``auto`` is resolved (it depends on the machine), against what the
    run used; ConfigError, one line naming each that differs. A key the saved file lacks is not checked."""
    saved = {key: state.saved.get(key) for key in RESOLVED}
    now = {key: OmegaConf.select(cfg, key) for key in RESOLVED}
    differ = [key for key in RESOLVED if saved[key] is not None and saved[key] != now[key]]
    if differ:
        named = ", ".join(f"{k} (saved {saved[k]}, now {now[k]}: what auto resolves to here)" for k in differ)
        fix = " ".join(f"{k}={saved[k]}" for k in differ)
        raise ConfigError(f"run folder {rdir} was started with another configuration: {named}; resume it with "
                          f"{fix}, or start another run with trainer.run_name=NAME")


def _show(v: Any) -> str:
    return "null" if v is None else str(v)


def saved_yaml(rdir: Path, max_steps: int) -> str:
    """The run's saved ``config.yaml`` text with ``trainer.max_steps`` set to ``max_steps`` (an extended run)."""
    saved = OmegaConf.load(rdir / "config.yaml")
    saved.trainer.max_steps = max_steps
    return OmegaConf.to_yaml(saved, resolve=True)


def pin_summary(rdir: Path, state: RunState) -> None:
    """Before an extension raises the saved trainer.max_steps: write into a ``summary.json`` that lacks it (written
    before it recorded one) the iterations it was written at, which its fallback would no longer give."""
    if state.summary is not None and "iterations_done" not in state.summary:
        (rdir / "summary.json").write_text(
            json.dumps({**state.summary, "iterations_done": state.iterations_done}, indent=2)
        )


def record_extension(client: Any, run_id: str, before: int, after: int, cfg_yaml: str) -> None:
    """An extended run in MLflow: its params are immutable and keep the trainer.max_steps it started with, so the
    tag ``max_steps_history`` (``3 -> 5``, longer after each extension) and the artifact ``config.yaml`` say the
    new one."""
    have = client.get_run(run_id).data.tags.get("max_steps_history") or str(before)
    client.set_tag(run_id, "max_steps_history", f"{have} -> {after}")
    client.log_text(run_id, cfg_yaml, "config.yaml")


def finished_message(rdir: Path, iterations: int) -> str:
    """The one line ``gearlab train`` prints for a run that has nothing left to do."""
    return (f"run {rdir} is finished ({iterations} of {iterations} iterations; model in {rdir / 'final'}); nothing "
            f"changed. To train it further, raise trainer.max_steps above {iterations} (same command with "
            f"trainer.max_steps=N: it resumes from the last checkpoint)")
