"""Build everything from a Config and run ``Trainer.fit``: the body of ``gearlab train``.

Order matters for "bad input fails before any work": ``preflight`` (gearlab.trainer.preflight) checks the model path,
task and assigner (cheap) before a model is loaded or a run is created.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from gearlab import credit
from gearlab.config import Config, ConfigError, to_yaml
from gearlab.models.answer_length import answer_budget_warning
from gearlab.models.loading import load_policy, warn_bf16_training
from gearlab.models.prompt_length import check_prompt_lengths, check_task_prompts
from gearlab.parallel import distributed
from gearlab.rollout.factory import resolve_engine
from gearlab.rollout.fast import resolve_attention
from gearlab.trainer.callbacks import IterationCheckpoint, IterationProgressBar, KeepStopSignals, PeriodicEval
from gearlab.trainer.data import PromptDataModule
from gearlab.trainer.determinism import deterministic_kernels
from gearlab.trainer.module import GRPOModule
from gearlab.tasks.base import Task
from gearlab.trainer.preflight import preflight
from gearlab.trainer.resume import RunState, check_resolved, check_resume, pin_summary, record_extension, saved_yaml
from gearlab.stopping import StopSignals
from gearlab.trainer.tracking import check_tracking_uri, make_logger, tracking_uri

log = logging.getLogger("gearlab")


def run_dir(cfg: Config) -> Path:
    name = cfg.trainer.run_name or f"{cfg.task.name}-{cfg.assigner.name}-s{cfg.trainer.seed}"
    return Path(cfg.trainer.output_dir) / name


def _is_launch_rank_zero() -> bool:
    """Global rank 0 as the launcher (torchrun, SLURM, Lightning's subprocess launcher) says, before any process
    group exists."""
    for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if var in os.environ:
            return int(os.environ[var]) == 0
    return True


@contextlib.contextmanager
def exclusive_lock(path: Path, who: str, busy: Callable[[str], str]) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the file ``path`` (created with its folder), writing ``who`` into it; when another
    process holds it, raise ConfigError(``busy(holder)``), ``holder`` being what that process wrote. The lock is the
    kernel's: it goes away with its process however that ends, so a file left by a dead process blocks nothing."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ConfigError(busy(holder)) from None
    try:
        f.seek(0)
        f.truncate()
        f.write(who)
        f.flush()
        yield
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


@contextlib.contextmanager
def run_folder_lock(rdir: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``rdir/.lock`` for the whole run, so a second ``gearlab train`` with the same run
    folder refuses at once instead of writing the same checkpoints and opening a second MLflow run
    (:func:`exclusive_lock`). Only launch rank 0 takes it."""
    if not _is_launch_rank_zero():
        yield
        return
    with exclusive_lock(rdir / ".lock", f"gearlab pid {os.getpid()}",
                        lambda holder: f"run folder {rdir} is in use by {holder}: wait for it to finish, or give this "
                                       f"run its own folder with trainer.run_name=NAME"):
        yield


class RunStop(StopSignals):
    """The stop scope of one training run (gearlab.stopping): the first Ctrl-C (SIGINT) or SIGTERM marks the
    module (``GRPOModule.interrupted``), which then finishes the current iteration, writes its checkpoint and stops, so
    the same command resumes exactly where it stopped (and MLflow holds one value per iteration). A second Ctrl-C
    aborts at once. Entered before the model loads, so a request during loading is kept for the module."""

    def __init__(self) -> None:
        super().__init__(self._tell)
        self.module: GRPOModule | None = None

    def attach(self, module: GRPOModule) -> None:
        self.module = module
        module.interrupted = module.interrupted or self.requested

    def _tell(self, signum: int, first: bool) -> None:
        if self.module is not None:
            self.module.interrupted = True
        if first and self.module is None:  # still loading (a warm start polls gearlab.stopping.pending_stop)
            log.warning("stop requested (%s) before training began: stopping", signal.Signals(signum).name)
        elif first:
            log.warning("stop requested (%s): finishing this iteration and writing a checkpoint; "
                        "Ctrl-C again aborts now", signal.Signals(signum).name)


@dataclass
class TrainResult:
    run_dir: Path
    mlflow_run_id: str
    tracking_uri: str
    metrics: dict[str, float]
    iterations_done: int = 0
    max_steps: int = 0
    stopped_early: bool = False  # trainer.stop_after / deadline or Ctrl-C / SIGTERM: the run can be resumed
    interrupted: bool = False  # Ctrl-C / SIGTERM
    stop_signal: int = 0  # the signal that stopped it (SIGINT 2, SIGTERM 15): the command exits with 128 + it
    already_finished: bool = False  # finished before this call, which changed nothing (gearlab.trainer.resume)
    eval_held_out: bool = True  # False: eval/* was measured on the training problems (the task has no test split)


def train(cfg: Config, checked: tuple[Task, credit.CreditAssigner] | None = None) -> TrainResult:
    """Run (or resume) one training run; bad input raises ConfigError before any work. ``checked``: what
    ``preflight(cfg)`` returned, when the caller ran it already (the command line does, before importing Lightning)."""
    task, assigner = checked if checked is not None else preflight(cfg)
    distributed.check(cfg)
    prompts_checked = check_task_prompts(cfg, task)
    check_tracking_uri(cfg)
    rdir = run_dir(cfg)
    run_state = check_resume(cfg, rdir)  # a resumed run keeps its configuration: one line naming what differs
    if run_state.finished_for(cfg):  # nothing to train: touch nothing (a re-run would rewrite final/ and summary.json)
        summary = run_state.summary or {}
        return TrainResult(rdir, summary.get("mlflow_run_id") or "", tracking_uri(cfg),
                           dict(summary.get("metrics") or {}),
                           iterations_done=run_state.iterations_done, max_steps=run_state.iterations_done,
                           already_finished=True)
    ckpt_dir = rdir / "checkpoints"
    resume: str | None = None
    if cfg.trainer.resume == "auto":
        resume = str(ckpt_dir / "last.ckpt") if (ckpt_dir / "last.ckpt").exists() else None
    elif cfg.trainer.resume != "never":
        if not Path(cfg.trainer.resume).exists():
            raise ConfigError(f"key 'trainer.resume': checkpoint not found: {cfg.trainer.resume}")
        resume = cfg.trainer.resume
    with deterministic_kernels(cfg), run_folder_lock(rdir), RunStop() as stop:  # before any CUDA work
        return _train_locked(cfg, task, assigner, rdir, ckpt_dir, resume, prompts_checked, run_state, stop)


def _train_locked(cfg: Config, task: Task, assigner: credit.CreditAssigner, rdir: Path, ckpt_dir: Path,
                  resume: str | None, prompts_checked: bool = False, run_state: RunState | None = None,
                  stop: RunStop | None = None) -> TrainResult:
    run_state = run_state or RunState()
    stop = stop or RunStop()
    if cfg.trainer.threads > 0:
        torch.set_num_threads(cfg.trainer.threads)
    L.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    model, tok, model_name = load_policy(cfg)
    warn_bf16_training(model, cfg.optim.lr)
    if not prompts_checked:  # the tokenizer could not be read before the model loaded (a hub id, a new embedded model)
        check_prompt_lengths(cfg, task, tok, model.config)
    if _is_launch_rank_zero() and (warning := answer_budget_warning(cfg, task, tok)):  # once, not once a rank
        log.warning(warning)
    # auto → concrete values, before config.yaml and the MLflow params are written: they record what ran
    cfg.rollout.engine = resolve_engine(cfg, model)
    cfg.rollout.fast.attention = resolve_attention(cfg)
    if cfg.rollout.engine == "fast":  # before the run directory or the MLflow run exists
        from gearlab.rollout.decoder import supports

        if reason := supports(model):
            raise ConfigError(
                f"key 'rollout.engine': fast decoding cannot run this model: {reason} (use rollout.engine=hf)"
            )
    check_resolved(cfg, run_state, rdir)
    cfg_yaml, extending = _record_config(cfg, run_state, rdir)
    logger = make_logger(cfg, rdir, model_name=model_name)
    if extending:
        log.warning("extending the run from %d to %d iterations (trainer.max_steps raised)", run_state.saved_max_steps,
                    cfg.trainer.max_steps)
        if logger is not None:
            record_extension(
                logger.experiment, logger.run_id, run_state.saved_max_steps, cfg.trainer.max_steps, cfg_yaml
            )
    module = GRPOModule(cfg, model, tok, task, assigner)
    stop.attach(module)
    dm = PromptDataModule(task, prompts_per_step=cfg.rollout.prompts_per_step, num_steps=cfg.trainer.max_steps,
                          seed=cfg.trainer.seed)
    ckpt = IterationCheckpoint(ckpt_dir, cfg.trainer.checkpoint_every, cfg.trainer.max_steps, cfg_yaml)
    callbacks: list[Callback] = [KeepStopSignals(stop), ckpt]
    if cfg.eval.num_problems > 0:
        callbacks.insert(1, PeriodicEval(cfg, task))  # before the checkpoint: the last eval lands in the run first
    if cfg.trainer.progress_bar:
        callbacks.append(IterationProgressBar(cfg.trainer.max_steps))
    trainer = L.Trainer(
        accelerator=cfg.trainer.accelerator, devices=cfg.trainer.devices, num_nodes=cfg.trainer.num_nodes,
        strategy=distributed.make_strategy(cfg), precision=cfg.trainer.precision,
        max_epochs=1, max_steps=-1, logger=logger if logger is not None else False, callbacks=callbacks,
        log_every_n_steps=cfg.trainer.log_every,
        enable_checkpointing=False, enable_progress_bar=cfg.trainer.progress_bar, enable_model_summary=False,
        num_sanity_val_steps=0, use_distributed_sampler=False, default_root_dir=str(rdir),
    )
    if resume:
        log.warning("resuming from %s", resume)
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=resume)
    except SystemExit:
        if stop.requested:  # Lightning ends a fit aborted by a second Ctrl-C with exit(1): it is an interrupt
            raise KeyboardInterrupt from None
        raise
    if getattr(module, "stopped_early", False):
        _mark_stopped(cfg, module, logger, ckpt)
        return _result(rdir, logger, dict(getattr(module, "last_metrics", {})), cfg, module, stop)
    metrics = _save_final(trainer, module, tok, rdir, logger)
    return _result(rdir, logger, metrics, cfg, module, stop)


def _record_config(cfg: Config, run_state: RunState, rdir: Path) -> tuple[str, bool]:
    """The run's ``config.yaml`` (its record, as its MLflow params) and whether this launch extends the run: written
    when the run starts; on resume left as it is (keys free to differ, gearlab.trainer.resume, are not history) but
    for a raised ``trainer.max_steps``. Returns (the YAML, extending)."""
    extending = run_state.extends(cfg)
    if not run_state.exists:
        cfg_yaml = to_yaml(cfg)
    else:
        cfg_yaml = saved_yaml(rdir, cfg.trainer.max_steps) if extending else (rdir / "config.yaml").read_text()
    rdir.mkdir(parents=True, exist_ok=True)
    if extending:
        pin_summary(rdir, run_state)
    if not run_state.exists or extending:  # whole or not at all: another rank of this launch may be reading it
        tmp = rdir / f".config.yaml.{os.getpid()}.tmp"
        tmp.write_text(cfg_yaml)
        os.replace(tmp, rdir / "config.yaml")
    return cfg_yaml, extending


def _mark_stopped(cfg: Config, module: GRPOModule, logger: Any, ckpt: IterationCheckpoint) -> None:
    """A run that stopped before ``trainer.max_steps`` (interrupt, ``trainer.stop_after`` / ``trainer.deadline``):
    say how to resume, and leave its MLflow run KILLED, not FINISHED, so that a comparison resumes it."""
    if module.interrupted:
        log.warning("interrupted after %d of %d iterations; checkpoint %s — run the same command to resume",
                    module.iterations_done, cfg.trainer.max_steps, ckpt.last)
    else:
        log.warning(
            "stopped after %d iterations (trainer.stop_after / trainer.deadline); run the same command to resume",
            module.iterations_done
        )
    if logger is not None:
        import mlflow

        mlflow.MlflowClient(logger._tracking_uri).set_terminated(logger.run_id, "KILLED")


def _save_final(trainer: L.Trainer, module: GRPOModule, tok: Any, rdir: Path, logger: Any) -> dict[str, float]:
    """The finished run's ``final/`` model and tokenizer and its ``summary.json`` (rank 0); every rank gathers the
    full state dict. Returns the last iteration's and evaluation's metrics."""
    state = distributed.full_state_dict(module.policy)  # collective: every rank takes part
    if getattr(module.policy.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # saved once, as the embedding (what save_pretrained does by itself)
    if trainer.is_global_zero:
        module.policy.save_pretrained(rdir / "final", state_dict=state)
        tok.save_pretrained(rdir / "final")
    metrics = dict(getattr(module, "last_metrics", {}), **getattr(module, "last_eval", {}))
    if trainer.is_global_zero:
        # iterations_done marks the run finished at that many (gearlab.trainer.resume): re-running it changes nothing
        (rdir / "summary.json").write_text(json.dumps({"mlflow_run_id": logger.run_id if logger else None,
                                                       "iterations_done": module.iterations_done,
                                                       "metrics": metrics}, indent=2))
    return metrics


def _result(rdir: Path, logger: Any, metrics: dict[str, float], cfg: Config, module: GRPOModule,
            stop: StopSignals | None = None) -> TrainResult:
    return TrainResult(rdir, logger.run_id if logger else "", logger._tracking_uri if logger else "", metrics,
                       iterations_done=module.iterations_done, max_steps=cfg.trainer.max_steps,
                       stopped_early=bool(getattr(module, "stopped_early", False)), interrupted=module.interrupted,
                       stop_signal=stop.signum if stop is not None and module.interrupted else 0,
                       eval_held_out=bool(getattr(module.task, "held_out", True)))
