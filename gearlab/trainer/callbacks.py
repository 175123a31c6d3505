"""The Lightning callbacks of a training run: gearlab's stop handler kept over Lightning's, the iteration
checkpoint, the periodic evaluation and the per-iteration progress bar (wired in by ``gearlab.trainer.train``)."""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import _update_n

from gearlab.config import Config
from gearlab.rollout.factory import engine_from_config
from gearlab.stopping import StopSignals
from gearlab.tasks.base import Task
from gearlab.trainer.module import GRPOModule
from gearlab.trainer.update import NonFiniteLossError

log = logging.getLogger("gearlab")


class KeepStopSignals(Callback):
    """Puts gearlab's SIGINT / SIGTERM handler back once Lightning has installed its own (when a fit starts, after the
    checkpoint is restored). Lightning's SIGTERM handler ends the fit with a SystemExit after the batch: exit 0, the
    MLflow run FAILED, no resume line, and on several processes a broadcast from inside the handler; gearlab's stops
    at the iteration boundary on every rank together (``GRPOModule``), exactly as Ctrl-C."""

    def __init__(self, stop: StopSignals) -> None:
        self.stop = stop

    def on_train_start(self, trainer, pl_module) -> None:
        self.stop.install()
        # a SIGTERM that came before this point went through Lightning's handler, which calls the handler it found
        # (gearlab's): the request is on record here already, and Lightning's own flag would end the fit wrongly
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None and hasattr(connector, "received_sigterm"):
            connector.received_sigterm = False


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

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        # a checkpoint written at the last iteration marks the data stream exhausted, and Lightning would then end
        # the fit at once: when trainer.max_steps was raised since (an extended run), more iterations follow
        done = checkpoint.get("gearlab", {}).get("iterations_done", 0)
        progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
        if done < self.total and isinstance(progress, dict) and progress.get("is_last_batch"):
            progress["is_last_batch"] = False

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, NonFiniteLossError):
            self.save(trainer, "nonfinite.ckpt")  # for inspection; last.ckpt stays the last good boundary


class PeriodicEval(Callback):
    """Evaluation on the task's test split (greedy accuracy, avg@k, pass@k) before training, every ``every``
    iterations and after the last; logged as ``eval/*`` at step = completed iterations. The run's tag ``eval_split``
    says which problems: ``test`` (held out) or ``train`` (a task without a separate test split, e.g. jsonl without
    test_path; then a warning says so at the start)."""

    def __init__(self, cfg: Config, task: Task) -> None:
        self.cfg, self.task = cfg, task
        self.engine = None  # one for every evaluation of the run: its compiled pieces and CUDA graphs are kept

    def _run(self, trainer: L.Trainer, module: GRPOModule) -> None:
        from gearlab.trainer.evaluation import cached_start_evaluation, evaluate_model

        if self.engine is None:
            self.engine = engine_from_config(module.tokenizer, self.task, self.cfg, model=module.policy)
        if module.iterations_done == 0 and trainer.world_size == 1:
            res = cached_start_evaluation(
                module.policy, module.tokenizer, self.task, self.cfg, self.cfg.model.name_or_path, self.engine
            )
        else:
            res = evaluate_model(module.policy, module.tokenizer, self.task, self.cfg, self.engine)
        k = self.cfg.eval.k
        # named as MLflow stores them ("@" is not allowed in an MLflow metric name), so the name logged, looked up
        # and documented is one: eval/avg_at_4, not eval/avg@4 that the logger would rename
        metrics = {f"eval/avg_at_{k}": res[f"avg@{k}"], f"eval/pass_at_{k}": res[f"pass@{k}"]}
        metrics.update({f"eval/{n}": v for n, v in res.items() if n.startswith("greedy_")})  # (eval.greedy on)
        if not res.get("cached"):  # a timing (not a value: kept out of eval/*); not in the report's s/iter
            metrics["time/eval_s"] = res["seconds"]
            log.info("evaluation at iteration %d: %.1f s", module.iterations_done, res["seconds"])
        if trainer.is_global_zero and trainer.logger is not None:
            trainer.logger.log_metrics(metrics, step=module.iterations_done)
        module.last_eval = metrics

    def on_train_start(self, trainer, pl_module) -> None:
        held_out = bool(getattr(self.task, "held_out", True))
        if trainer.is_global_zero:
            if not held_out:  # said at every start (a resumed run too): nothing may call these numbers held-out
                log.warning("the evaluation uses the TRAINING problems: task %r has no separate test split (jsonl: set "
                            "task.options.test_path); eval/* measures fitting, not generalisation", self.task.name)
            if trainer.logger is not None:
                trainer.logger.experiment.set_tag(trainer.logger.run_id, "eval_split", "test" if held_out else "train")
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
