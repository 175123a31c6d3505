"""The closing lines a command prints: where its runs are and the commands to look at them (``gearlab train``,
``gearlab compare``, ``gearlab report``)."""
from __future__ import annotations

import shlex
from pathlib import Path


def mlflow_ui_command(uri: str, experiment_id: str | None = None) -> str:
    """How to look at a tracking store: the ``mlflow ui`` line for a local SQLite file (path shown relative to
    the current directory when it is below it), else the server's address. With ``experiment_id``, the address that
    opens that experiment's runs (:func:`gearlab.trainer.tracking.runs_url`): MLflow 3's UI otherwise starts on its
    GenAI pages, whatever the experiment's kind."""
    from gearlab.trainer.tracking import runs_url

    if uri.startswith("sqlite:///"):
        p = Path(uri[len("sqlite:///"):])
        try:
            p = p.relative_to(Path.cwd())
        except ValueError:
            pass
        line = f"mlflow ui --backend-store-uri sqlite:///{p}"
        return f"{line}, then open {runs_url(uri, experiment_id)}" if experiment_id else line
    if experiment_id and uri.lower().startswith(("http://", "https://")):
        return f"open {runs_url(uri, experiment_id)}"
    return f"open {uri} in a browser"


def experiment_id(uri: str, *, run_id: str | None = None, name: str | None = None) -> str | None:
    """The MLflow experiment id of a run or of an experiment name at ``uri``; None when the store cannot say (the
    closing lines then show the store without the address of the runs)."""
    import mlflow

    try:
        client = mlflow.MlflowClient(uri)
        if run_id:
            return client.get_run(run_id).info.experiment_id
        exp = client.get_experiment_by_name(name) if name else None
        return exp.experiment_id if exp is not None else None
    except Exception:  # a summary line must not fail a finished run
        return None


def compare_summary(cfg) -> str:
    """The closing lines of ``gearlab compare``: where the runs are and the commands to look at them."""
    from gearlab.commands.inspect import inspect_command
    from gearlab.trainer.tracking import tracking_uri

    name, base, seed = cfg.compare.name, cfg.compare.baseline, cfg.compare.seeds[0]
    model = Path(cfg.trainer.output_dir) / name / f"{base}-s{seed}" / "final"
    return "\n".join([
        f"runs: {Path(cfg.trainer.output_dir) / name}/<method>-s<seed>/ (each with its trained model in final/)",
        "look at them: "
        f"{mlflow_ui_command(tracking_uri(cfg), experiment_id(tracking_uri(cfg), name=f'compare/{name}'))}"
        f"  (experiment compare/{name}; the comparison's report is the parent run's description)",
        f"see credit on one batch: {inspect_command(cfg, model)}",
        f"rebuild the report from MLflow alone: gearlab report {name}",
    ])


def train_summary(res, argv: list[str], cfg=None) -> str:
    """The closing lines of ``gearlab train``: where it stopped, the final evaluation (called held-out only when it
    was), iterations without learning signal, where the run is and the commands to look at it. ``cfg``: the run's
    config, for the ``gearlab inspect`` line (default: the run folder's config.yaml)."""
    m, rdir = res.metrics, res.run_dir
    lines = [""]
    if res.stopped_early:
        why = "interrupted" if res.interrupted else "stopped (trainer.stop_after / trainer.deadline)"
        lines.append(f"{why} after {res.iterations_done} of {res.max_steps} iterations; the checkpoint is "
                     f"{rdir / 'checkpoints' / 'last.ckpt'}")
        lines.append(f"resume (same MLflow run, exact): gearlab {shlex.join(argv)}")
    else:
        lines.append(f"done: {res.iterations_done} iterations")
        ev = {k: v for k, v in m.items() if k.startswith("eval/")}
        if ev:
            shown = ", ".join(f"{k[5:]} {100 * v:.1f}%" for k, v in sorted(ev.items())
                              if k[5:] in ("greedy_accuracy",) or k[5:].startswith(("avg_at_", "pass_at_")))
            if getattr(res, "eval_held_out", True):
                lines.append(f"final held-out evaluation: {shown}")
            else:
                lines.append(f"final evaluation on the TRAINING problems (the task has no separate test split; "
                             f"not held-out): {shown}")
        lines.append(f"trained model: {rdir / 'final'}")
    last = {k: v for k, v in m.items() if k in ("train/reward", "train/accuracy")}
    if last:
        lines.append("last iteration: " + ", ".join(f"{k[6:]} {v:.3f}" for k, v in sorted(last.items())))
    silent = int(m.get("train/no_signal_iterations_total", 0))
    if silent:
        lines.append(f"iterations without learning signal (every group's rewards equal): {silent} of "
                     f"{res.iterations_done}")
    lines.append(f"run folder: {rdir}   MLflow run {res.mlflow_run_id}")
    exp_id = experiment_id(res.tracking_uri, run_id=res.mlflow_run_id) if res.mlflow_run_id else None
    lines.append(f"look at it: {mlflow_ui_command(res.tracking_uri, exp_id)}")
    if not res.stopped_early:
        from gearlab.commands.inspect import inspect_command

        cfg = cfg if cfg is not None else _run_config(rdir)
        if cfg is not None:
            lines.append(f"see its credit on one batch: {inspect_command(cfg, rdir / 'final')}")
    return "\n".join(lines)


def _run_config(rdir):
    """The config a run folder recorded (its config.yaml) as a Config, or None when there is none."""
    from omegaconf import OmegaConf

    from gearlab.config import Config

    path = rdir / "config.yaml"
    try:
        return OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path)) if path.is_file() else None
    except Exception:  # written by another gearlab version: no inspect line rather than a failed summary
        return None
