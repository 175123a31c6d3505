"""``gearlab compare``: a paired head-to-head of credit methods, recorded in MLflow.

Every (assigner, seed) pair is one child training run. For a given seed all children start from
the same checkpoint, see the same prompts in the same order (the data stream is a function of the
seed) and draw their samples from the same per-step seeds, so the credit method is the only
difference between two children of one seed. One MLflow experiment holds a parent run for the
comparison and one child run per pair (tags ``comparison_id``, ``assigner``, ``seed``).
Re-running the same command skips finished children and resumes a partial one from its checkpoint (a raised
``trainer.max_steps`` extends finished ones; any other change to a child's configuration is refused before any work,
gearlab.trainer.resume). One comparison runs at a time: a second ``gearlab compare`` of the same name stops with one
line naming the first (``<output_dir>/<name>/.lock``). Ctrl-C or SIGTERM: the running children stop at an iteration
boundary with a checkpoint, none starts after it, and the command exits with 130 / 143 (gearlab.stopping).
"""
from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any, Callable

import mlflow
from mlflow.entities import RunStatus
from omegaconf import OmegaConf

from gearlab import credit
from gearlab.config import Config, ConfigError, flatten, load_config
from gearlab.core.metrics import sanitize_metric_key
from gearlab.commands.compare_pool import Child, _Relay, _run_pool, run_child, worker_gpus
from gearlab.stopping import StopSignals
from gearlab.trainer.tracking import ensure_experiment, git_sha, record_versions, tracking_uri, version_tags


def experiment_name(cfg: Config) -> str:
    return f"compare/{cfg.compare.name}"


def plan(cfg: Config, base_overrides: list[str], model_path: str, parent_id: str,
         names: list[str] | None = None) -> list[Child]:
    """Seed-major order, so an interrupted comparison has every method for its first seeds; within a seed the
    baseline runs last. ``names``: the methods (default ``compare.assigners``; grid points already expanded by
    :func:`methods_of`)."""
    names = list(names or cfg.compare.assigners)
    # the baseline of a credit comparison is usually plain GRPO, the cheapest method (every other one adds passes to
    # it): queued last in its seed, the workers' last children are short ones, so neither waits long for the other
    # (in seed-then-listed order the main job's 2 workers ended on one GEAR child, the other worker idle ~70 s)
    names = [a for a in names if a != cfg.compare.baseline] + [a for a in names if a == cfg.compare.baseline]
    out = []
    for seed in cfg.compare.seeds:
        for a in names:
            out.append(Child(a, seed, [*base_overrides, f"assigner={a}", f"trainer.seed={seed}",
                                       f"model.name_or_path={model_path}",
                                       f"trainer.run_name={cfg.compare.name}/{a}-s{seed}",
                                       f"logging.experiment={experiment_name(cfg)}",
                                       f"logging.tracking_uri={tracking_uri(cfg)}",
                                       f"logging.tags.comparison_id={cfg.compare.name}",
                                       f"logging.parent_run_id={parent_id}"]))
    return out


def find_runs(client: mlflow.MlflowClient, exp_id: str, comparison: str
              ) -> tuple[object | None, dict[tuple[str, int], object]]:
    """(parent run, {(assigner, seed): child run}) of a comparison."""
    runs = client.search_runs([exp_id], f"tags.comparison_id = '{comparison}'", max_results=5000)
    parent, children = None, {}
    for r in runs:
        if r.data.tags.get("gearlab.role") == "parent":
            parent = r
        elif "assigner" in r.data.tags:
            children[(r.data.tags["assigner"], int(r.data.tags["seed"]))] = r
    return parent, children


def methods_of(cfg: Config) -> list[str]:
    """The comparison's methods: ``compare.assigners`` with every ``compare.grid`` entry expanded into one method per
    point (``gear`` → ``gear:q_on=0.8``, ``gear:q_on=0.9``, …). ConfigError for an unknown method or grid key."""
    from gearlab.credit.methods import available_methods, expand_grid, unknown_methods

    grid = OmegaConf.to_container(cfg.compare.grid) if cfg.compare.grid else {}
    for m, axes in grid.items():
        if not isinstance(axes, dict) or not axes:
            raise ConfigError(f"key 'compare.grid.{m}': expected option lists, e.g. compare.grid.{m}.q_on=[0.8,0.9]")
    names = expand_grid(list(cfg.compare.assigners), grid)
    unknown = unknown_methods(names)
    if unknown:
        raise ConfigError(f"key 'compare.assigners': unknown {unknown}; known: {', '.join(available_methods())}")
    if len(set(names)) != len(names):
        raise ConfigError(f"key 'compare.assigners': a method is listed twice: {names}")
    return names


def primary_metric(cfg: Config) -> str:
    """``compare.metric`` by the name MLflow stores it under ("auto": ``eval/avg_at_<eval.k>``; a name typed with "@",
    ``eval/avg@4``, becomes ``eval/avg_at_4``), so the parent's tag, the report and the run agree on one name."""
    return f"eval/avg_at_{cfg.eval.k}" if cfg.compare.metric == "auto" else sanitize_metric_key(cfg.compare.metric)


def compare(cfg: Config, base_overrides: list[str]) -> dict:
    from gearlab.models.prompt_length import check_task_prompts
    from gearlab.trainer.tracking import check_tracking_uri
    from gearlab.trainer.preflight import preflight

    for spec in cfg.assigner.plugins:
        credit.load_module(spec)
    names = methods_of(cfg)
    if not cfg.compare.seeds:
        raise ConfigError("key 'compare.seeds': at least one seed is needed")
    if cfg.compare.baseline not in names:
        raise ConfigError(f"key 'compare.baseline': {cfg.compare.baseline!r} is not among compare.assigners {names}")
    for a in names:  # every child's configuration is checked before any work
        task, _ = preflight(load_config([*base_overrides, f"assigner={a}"]))
    check_task_prompts(cfg, task)  # the children share the task and the model: once for all (each child checks too)
    check_tracking_uri(cfg)
    relay = _Relay()
    with comparison_lock(cfg), StopSignals(relay) as stop:
        return _compare_locked(cfg, base_overrides, names, stop, relay)


def comparison_lock(cfg: Config) -> contextlib.AbstractContextManager[None]:
    """One ``gearlab compare`` of a name at a time (``<output_dir>/<name>/.lock``): a second would skip, re-run or
    resume the same children beside the first. It refuses with one line naming the holder's pid."""
    from gearlab.trainer.train import exclusive_lock

    folder = Path(cfg.trainer.output_dir) / cfg.compare.name
    return exclusive_lock(folder / ".lock", f"gearlab compare pid {os.getpid()}",
                          lambda holder: f"comparison {cfg.compare.name!r} ({folder}) is in use by {holder}: wait "
                                         f"for it to finish, or give this comparison another compare.name")


def _start_model(cfg: Config) -> str:
    """The folder every child starts from, made once: an embedded tiny model's warm start (copied when the shipped
    one matches), a pretrained model fine-tuned on the task's demonstrations (``compare.warm_start``), or
    ``model.name_or_path`` as it is."""
    from gearlab.models.loading import WARMSTARTED, check_warm_start_folder, embedded_dir, run_warmstart, warmstart_dir

    ref = cfg.model.name_or_path
    if ref in WARMSTARTED:
        from gearlab.models.shipped import shipped_matches

        d = embedded_dir(cfg, ref)
        how = "copying the shipped warm start" if shipped_matches(cfg, ref) else "warm-starting the embedded model"
    elif cfg.compare.warm_start:
        d = warmstart_dir(cfg)
        how = f"fine-tuning {ref} on {cfg.task.name}'s demonstrations ({cfg.warmstart.steps} steps)"
    else:
        return ref
    if (d / "config.json").is_file():
        check_warm_start_folder(cfg, d)
    else:
        print(f"[compare] {how} into {d}", flush=True)
        # in a process of its own: on a GPU the allocator's cache of the fine-tuning (~100 GiB for SmolLM2-135M on an
        # H200) would otherwise stay with this process while the children train next to it
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            pool.submit(run_warmstart, cfg).result()
    return str(d.resolve())


def _compare_locked(cfg: Config, base_overrides: list[str], names: list[str], stop: StopSignals, relay: _Relay) -> dict:
    model_path = _start_model(cfg)
    client = mlflow.MlflowClient(tracking_uri(cfg))
    exp_id = ensure_experiment(tracking_uri(cfg), experiment_name(cfg), client)
    parent, done = find_runs(client, exp_id, cfg.compare.name)
    resumed = parent is not None
    parent = _parent_run(cfg, client, exp_id, parent, names, model_path)
    pid = parent.info.run_id
    if cfg.compare.max_minutes > 0:  # every child stops at an iteration boundary after this time, resumable
        cfg.trainer.deadline = time.time() + 60 * cfg.compare.max_minutes
        base_overrides = [*base_overrides, f"trainer.deadline={cfg.trainer.deadline:.3f}"]
    children = plan(cfg, base_overrides, model_path, pid, names)
    todo = _todo(cfg, client, children, done)
    if resumed:
        client.update_run(pid, status="RUNNING")
        record_versions(client, pid)  # a changed version is kept as "old -> new"
    primary = parent.data.tags.get("primary_metric", primary_metric(cfg))
    if sanitize_metric_key(primary) != sanitize_metric_key(primary_metric(cfg)):  # eval/avg@4 names eval/avg_at_4
        print(f"[compare] WARNING: this comparison named {primary!r} as its primary metric before it ran; the report "
              f"stays on it (gearlab report {cfg.compare.name} compare.metric=... shows another)", flush=True)
    print(f"[compare] {cfg.compare.name}: {len(children)} runs ({len(names)} methods × {len(cfg.compare.seeds)} "
          "seeds), "
          f"{len(children) - len(todo)} already finished, {len(todo)} to run, workers={cfg.compare.workers}; "
          f"primary metric: {primary} (final value, paired by seed against {cfg.compare.baseline})", flush=True)
    t_start = time.time()
    prog = _Progress(len(todo), cfg.compare.workers,
                     lambda c, err: _mark_failed(client, exp_id, cfg.compare.name, c, err))
    aborted = _run_children(cfg, todo, prog, stop, relay)
    if stop.requested or prog.stopped or aborted:
        ran = set(prog.finished) | set(prog.stopped) | set(prog.failed)
        not_started = [c.label for c in todo if c.label not in ran]
        why = (f"stop requested by {stop.signal_name}" if stop.requested
               else "a child stopped early: compare.max_minutes / trainer.stop_after")
        print(f"[compare] interrupted ({why}): {len(prog.finished)} finished, {len(prog.stopped)} stopped at an "
              f"iteration boundary, {len(not_started)} not started, {len(prog.failed)} failed (of {len(todo)} to run); "
              f"run the same command to resume (finished runs are kept, stopped ones resume)", flush=True)
        client.set_terminated(pid, "KILLED")
        return {"failed": prog.failed, "stopped": prog.stopped, "finished": prog.finished,
                "not_started": not_started, "interrupted": True, "signal": stop.signum, "report": None, "plot": None}
    from gearlab.commands.report import build_report

    rep = build_report(tracking_uri(cfg), cfg.compare.name, metric=primary, baseline=cfg.compare.baseline,
                       target=cfg.compare.target, effect=cfg.compare.effect, more_curves=list(cfg.compare.curves),
                       out_dir=Path(cfg.trainer.output_dir) / cfg.compare.name / "report")
    client.set_terminated(pid, "FINISHED" if not prog.failed else "FAILED")
    print(f"[compare] {len(children) - len(prog.failed)}/{len(children)} runs finished in "
          f"{(time.time() - t_start) / 60:.1f} min")
    print(f"report: {rep.markdown_path}\nplot: {rep.plot_path}")
    return {"failed": prog.failed, "report": str(rep.markdown_path), "plot": str(rep.plot_path), "table": rep.table}


def _parent_run(cfg: Config, client: mlflow.MlflowClient, exp_id: str, parent: Any, names: list[str],
                model_path: str) -> Any:
    """The comparison's parent MLflow run: made with its tags, params and config when new; when resumed, checked to
    start from the same weights (sha256 of ``model_path``) — one line and exit 2 if not."""
    from gearlab.models.checkpoints import weights_digest

    digest = weights_digest(model_path)
    if parent is not None:
        before = parent.data.tags.get("start_sha256")
        if before and digest and before != digest:  # e.g. a warm start redone on another machine
            raise ConfigError(f"key 'model.name_or_path': the starting weights {model_path} (sha256 {digest[:12]}) "
                              f"are not those comparison {cfg.compare.name!r} started from (sha256 {before[:12]}); "
                              f"restore that model or give a new compare.name")
        return _extend_design(client, parent, names, list(cfg.compare.seeds))
    parent = client.create_run(exp_id, run_name=f"{cfg.compare.name}", tags={
        "comparison_id": cfg.compare.name, "gearlab.role": "parent", "git_sha": git_sha(), "task": cfg.task.name,
        "assigners": ",".join(names), "methods_json": json.dumps(names), "seeds": ",".join(map(str, cfg.compare.seeds)),
        "baseline": cfg.compare.baseline, "primary_metric": primary_metric(cfg), "effect": str(cfg.compare.effect),
        **({"start_sha256": digest} if digest else {}), **version_tags()})
    params = {k: str(v)[:6000] for k, v in flatten(cfg).items() if not k.startswith("assigner.")}
    for k, v in params.items():
        client.log_param(parent.info.run_id, k, v)
    client.log_text(parent.info.run_id, OmegaConf.to_yaml(cfg), "config.yaml")
    return parent


def _extend_design(client: mlflow.MlflowClient, parent: Any, names: list[str], seeds: list[int]) -> Any:
    """A resumed comparison run with more methods or seeds than it started with (its first sessions ran a part of
    the design): the parent's design tags, which the report reads, become the union (the old order first)."""
    tags = parent.data.tags
    have = (json.loads(tags["methods_json"]) if "methods_json" in tags
            else [a for a in tags.get("assigners", "").split(",") if a])
    had_seeds = [int(s) for s in tags.get("seeds", "").split(",") if s]
    methods = have + [a for a in names if a not in have]
    all_seeds = had_seeds + [s for s in seeds if s not in had_seeds]
    if methods == have and all_seeds == had_seeds:
        return parent
    print(f"[compare] the comparison grows: methods {have} -> {methods}, seeds {had_seeds} -> {all_seeds}", flush=True)
    for k, v in (("methods_json", json.dumps(methods)), ("assigners", ",".join(methods)),
                 ("seeds", ",".join(map(str, all_seeds)))):
        client.set_tag(parent.info.run_id, k, v)
    return client.get_run(parent.info.run_id)


def _todo(cfg: Config, client: mlflow.MlflowClient, children: list[Child], done: dict[tuple[str, int], Any]
          ) -> list[Child]:
    """The children still to run: not finished, or finished with a ``trainer.max_steps`` this command raises. Every
    child's run folder is checked against its configuration first (one line and exit 2 on a conflict, before any
    child runs); an unfinished MLflow run whose folder is gone is deleted (the child starts again from 0)."""
    from gearlab.trainer.resume import check_resume
    from gearlab.trainer.train import run_dir

    extended = set()
    for c in children:
        child_cfg = load_config(c.overrides)
        try:
            if check_resume(child_cfg, run_dir(child_cfg)).extends(child_cfg):
                extended.add(c.label)
        except ConfigError as e:
            raise ConfigError(f"comparison {cfg.compare.name!r}, child {c.label}: {e}") from None
    todo = [c for c in children if (c.assigner, c.seed) not in done or c.label in extended
            or done[(c.assigner, c.seed)].info.status != RunStatus.to_string(RunStatus.FINISHED)]
    logs = Path(cfg.trainer.output_dir) / cfg.compare.name
    for c in todo:  # a partial run whose folder is gone (a store moved to another machine without checkpoints)
        old = done.get((c.assigner, c.seed))  # starts again from iteration 0: its stale record must not be reported
        if old is not None and not (logs / c.label / "mlflow_run_id").is_file():
            client.delete_run(old.info.run_id)
            print(f"[compare] {c.label}: no local checkpoint for its unfinished MLflow run {old.info.run_id}; "
                  f"that run is deleted and the child starts again", flush=True)
    return todo


class _Progress:
    """What became of each child that ran (finished / stopped / failed), printed as it ends with an ETA."""

    def __init__(self, total: int, workers: int, on_failure: Callable[[Child, str], None]) -> None:
        self.total, self.workers, self.on_failure = total, workers, on_failure
        self.durations: list[float] = []
        self.finished: list[str] = []
        self.stopped: list[str] = []
        self.failed: list[str] = []

    def __call__(self, c: Child, outcome: str, secs: float, err: str = "") -> None:
        if outcome == "not_started":  # queued when a stop came: counted at the end
            return
        self.durations.append(secs)
        left = self.total - len(self.durations)
        eta = sum(self.durations) / len(self.durations) * left / max(1, self.workers)
        status = {"ok": "finished", "stopped": "stopped (resumes on re-run)"}.get(
            outcome, f"FAILED ({err.strip().splitlines()[-1][:120] if err.strip() else 'error'})")
        print(f"[compare] [{len(self.durations)}/{self.total}] {c.label:20s} {status} in {secs:.0f}s — "
              f"ETA {eta / 60:.1f} min", flush=True)
        if outcome == "stopped":
            self.stopped.append(c.label)
        elif outcome == "ok":
            self.finished.append(c.label)
        else:
            self.failed.append(c.label)
            self.on_failure(c, err)


def _run_children(cfg: Config, todo: list[Child], prog: _Progress, stop: StopSignals, relay: _Relay) -> bool:
    """Run ``todo`` one by one or ``compare.workers`` at a time, reporting each to ``prog``; True if aborted (Ctrl-C
    twice: the running children were killed, their last checkpoints stay)."""
    # fixed by the config when given (results then do not depend on the machine's core count)
    threads = cfg.trainer.threads or max(1, (os.cpu_count() or 1) // max(1, cfg.compare.workers))
    try:
        if cfg.compare.workers <= 1:
            for c in todo:
                if stop.requested:  # Ctrl-C / SIGTERM: no child starts after it
                    break
                outcome, err, secs = run_child(c.overrides)
                prog(c, outcome, secs, err)
                if outcome == "stopped":  # a signal, or trainer.deadline (compare.max_minutes): the rest waits
                    break
        else:
            gpus = worker_gpus(cfg.compare.workers, cfg.compare.gpus, os.environ.get("CUDA_VISIBLE_DEVICES"),
                               _cuda_count())
            if gpus:
                print(f"[compare] workers spread over GPUs: {', '.join(gpus)}", flush=True)
            _run_pool(todo, cfg.compare.workers, threads, Path(cfg.trainer.output_dir) / cfg.compare.name, prog,
                      stop, relay, gpus)
    except KeyboardInterrupt:
        return True
    return False


def _cuda_count() -> int:
    """CUDA devices this process sees, without creating a CUDA context here (the children own the GPUs)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _mark_failed(client: mlflow.MlflowClient, exp_id: str, comparison: str, c: Child, err: str) -> None:
    _, runs = find_runs(client, exp_id, comparison)
    run = runs.get((c.assigner, c.seed))
    if run is None:  # it died before its MLflow run existed: record a failed child anyway
        run = client.create_run(exp_id, run_name=f"{comparison}/{c.label}", tags={
            "comparison_id": comparison, "assigner": c.assigner, "seed": str(c.seed)})
    client.set_tag(run.info.run_id, "error", err.strip()[-4000:] or "unknown error")
    client.set_terminated(run.info.run_id, "FAILED")
