"""``gearlab`` command line: train, warmstart, eval.

Every command takes OmegaConf overrides: ``group=name`` picks conf/<group>/<name>.yaml
(assigner, task, model, experiment); ``a.b=value`` sets one key. Configuration errors print one
line and exit with code 2 before any work starts.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import textwrap

HELP = textwrap.dedent("""\
    usage: gearlab <command> [overrides ...]

    GRPO post-training of language models with pluggable credit assignment.

    commands:
      warmstart   supervised warm-start of the embedded tiny model on the embedded task
      train       GRPO training; the credit method is `assigner=NAME`
      eval        greedy accuracy and pass@k of a model or checkpoint on a task's test split
      assigners [NAME]  list the registered credit assigners; with NAME: its options, defaults and docs
      check-assigner NAME [overrides]   run the contract kit on a credit method (exit 1 if it fails)
      new-assigner NAME                 write assigners/NAME.py, conf/assigner/NAME.yaml and its test
      inspect     run several assigners on one sampled batch; write credit.json, credit.html, credit.png
      compare     paired comparison: assigners=[grpo,gear,...] seeds=[0,1,2] (one MLflow parent + a child per pair)
      report NAME rebuild a comparison's table and plot from MLflow alone (also a remote tracking server)
      credit-eval score every credit method against the located first error of failed responses (credit_eval.json)
      replay      run one cached set of rollouts through several assigners and log how their credit differs
      export      a training checkpoint (a file, or a sharded FSDP2 folder) -> a Hugging Face model folder

    overrides (any command):
      assigner=NAME            conf/assigner/NAME.yaml   (list: gearlab assigners)
      task=NAME                conf/task/NAME.yaml
      model=NAME               conf/model/NAME.yaml, or model.name_or_path=PATH_OR_HUB_ID
      experiment=NAME          conf/experiment/NAME.yaml (applied first)
      section.key=value        any key, e.g. trainer.max_steps=20 rollout.group_size=8 optim.lr=1e-5

    examples:
      gearlab warmstart
      gearlab train assigner=grpo trainer.max_steps=20
      gearlab eval model.name_or_path=runs/arith-grpo-s0/final eval.k=4

    MLflow: runs go to sqlite:///<trainer.output_dir>/mlflow.db unless MLFLOW_TRACKING_URI or
    logging.tracking_uri says otherwise; view them with
      mlflow ui --backend-store-uri sqlite:///runs/mlflow.db
    """)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(HELP)
        return 0
    cmd, overrides = argv[0], argv[1:]
    if any(a in ("-h", "--help") for a in overrides):
        print(HELP)
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _quiet()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # the report reads many small artifacts
    from gearlab.config import ConfigError, load_config

    if cmd == "new-assigner":
        return _new_assigner(overrides)
    if cmd == "report":
        if not overrides or "=" in overrides[0]:
            print("gearlab: error: usage: gearlab report COMPARISON [compare.metric=...] [compare.target=0.5]", file=sys.stderr)
            return 2
        overrides = [f"compare.name={overrides[0]}", *overrides[1:]]
    if cmd == "assigners" and overrides and "=" not in overrides[0]:
        return _describe_assigner(overrides[0], overrides[1:])
    if cmd == "compare":  # short forms: assigners=[...] seeds=[...] workers=N
        short = {"assigners": "compare.assigners", "seeds": "compare.seeds", "workers": "compare.workers", "name": "compare.name"}
        overrides = [f"{short[o.split('=', 1)[0]]}={o.split('=', 1)[1]}" if o.split("=", 1)[0] in short else o for o in overrides]
    if cmd == "check-assigner":
        if not overrides or "=" in overrides[0]:
            print("gearlab: error: usage: gearlab check-assigner NAME [overrides]", file=sys.stderr)
            return 2
        overrides = [f"assigner={overrides[0]}", *overrides[1:]]
    commands = {"train": _train, "warmstart": _warmstart, "eval": _eval, "assigners": _assigners,
                "check-assigner": _check_assigner, "inspect": _inspect, "compare": None, "report": _report, "replay": _replay,
                "credit-eval": _credit_eval,
                "export": _export}
    if cmd not in commands:
        print(f"gearlab: error: unknown command {cmd!r}; commands: {', '.join(commands)}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(overrides)
        if cmd == "compare":
            from gearlab.commands.compare import compare

            base = [o for o in overrides if not o.startswith(("compare.", "assigner=", "assigner.name=", "assigner.base="))]
            res = compare(cfg, base)
            if res.get("interrupted"):
                return 130
            print(compare_summary(cfg))
            print("\n" + res["table"])  # last: the paired table, the credit-eval table, the learning and power lines
            return 1 if res["failed"] else 0
        if cmd == "report":  # the metric the comparison named before it ran, unless one is asked for here
            return _report(cfg, explicit_metric=any(o.startswith("compare.metric=") for o in overrides))
        return commands[cmd](cfg)
    except ConfigError as e:
        print(f"gearlab: error: {e}", file=sys.stderr)
        return 2


def _export(cfg) -> int:
    from gearlab.commands.export import export

    print(f"exported: {export(cfg)}")
    return 0


def _quiet() -> None:
    """Silence known-harmless library chatter so that gearlab's own progress lines stay readable."""
    import warnings

    for pattern in (".*transfer_batch_to_device.*", ".*LeafSpec.*", ".*module\\(s\\) in eval mode.*",
                    ".*does not have many workers.*", ".*is not resumable.*"):
        warnings.filterwarnings("ignore", message=pattern)
    # Lightning sets its loggers to INFO and adds a handler when imported: import it first, then quiet it
    # (device lines, "Tip: try litlogger", "weights_only was not set"). gearlab's own warnings stay.
    import lightning.pytorch  # noqa: F401

    for name in ("lightning.pytorch", "lightning.fabric", "mlflow.store.db.utils", "alembic", "mlflow"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("lightning.pytorch").propagate = False  # it has its own handler; the root's would repeat it
    # kept: each process's "Initializing distributed: GLOBAL_RANK: r, MEMBER: r+1/world" line (multi-process runs)
    logging.getLogger("lightning.fabric.utilities.distributed").setLevel(logging.INFO)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def mlflow_ui_command(uri: str) -> str:
    """How to look at a tracking store: the ``mlflow ui`` line for a local SQLite file (path shown relative to
    the current directory when it is below it), else the server's address."""
    if uri.startswith("sqlite:///"):
        from pathlib import Path

        p = Path(uri[len("sqlite:///"):])
        try:
            p = p.relative_to(Path.cwd())
        except ValueError:
            pass
        return f"mlflow ui --backend-store-uri sqlite:///{p}"
    return f"open {uri} in a browser"


def compare_summary(cfg) -> str:
    """The closing lines of ``gearlab compare``: where the runs are and the commands to look at them."""
    from pathlib import Path

    from gearlab.trainer.tracking import tracking_uri

    name, base, seed = cfg.compare.name, cfg.compare.baseline, cfg.compare.seeds[0]
    model = Path(cfg.trainer.output_dir) / name / f"{base}-s{seed}" / "final"
    return "\n".join([
        f"runs: {Path(cfg.trainer.output_dir) / name}/<method>-s<seed>/ (each with its trained model in final/)",
        f"look at them: {mlflow_ui_command(tracking_uri(cfg))}  (experiment compare/{name})",
        f"see credit on one batch: gearlab inspect model.name_or_path={model}",
        f"rebuild the report from MLflow alone: gearlab report {name}",
    ])


def _train(cfg) -> int:
    from gearlab.trainer.train import train

    res = train(cfg)
    m = res.metrics
    if not res.mlflow_run_id:  # not global rank 0 of a multi-process run: rank 0 reports
        return 0
    if cfg.credit_eval.after_training:
        from gearlab.commands.credit_eval import after_training, markdown

        rec = after_training(cfg, res)
        if rec is not None:
            print(markdown(rec))
    print(train_summary(res, sys.argv[1:] if sys.argv[1:2] == ["train"] else ["train"]))
    return 0


def train_summary(res, argv: list[str]) -> str:
    """The closing lines of ``gearlab train``: where it stopped, the final held-out numbers, where the run is and
    the commands to look at it."""
    import shlex

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
                              if k[5:] in ("greedy_accuracy",) or k[5:].startswith(("avg@", "pass@")))
            lines.append(f"final held-out evaluation: {shown}")
        lines.append(f"trained model: {rdir / 'final'}")
    last = {k: v for k, v in m.items() if k in ("train/reward", "train/accuracy")}
    if last:
        lines.append("last iteration: " + ", ".join(f"{k[6:]} {v:.3f}" for k, v in sorted(last.items())))
    lines.append(f"run folder: {rdir}   MLflow run {res.mlflow_run_id}")
    lines.append(f"look at it: {mlflow_ui_command(res.tracking_uri)}")
    if not res.stopped_early:
        lines.append(f"see its credit on one batch: gearlab inspect model.name_or_path={rdir / 'final'}")
    return "\n".join(lines)


def _warmstart(cfg) -> int:
    from gearlab.models.loading import WARMSTARTED, embedded_dir, run_warmstart

    out = run_warmstart(cfg)
    print(json.dumps(out, indent=2, default=str))
    ref = cfg.model.name_or_path if cfg.model.name_or_path in WARMSTARTED else "embedded:tiny-arith"
    print(f"warm-started model: {embedded_dir(cfg, ref)}")
    return 0


def _eval(cfg) -> int:
    from gearlab.commands.evaluate import evaluate

    res = evaluate(cfg)
    print(json.dumps(res, indent=2))
    return 0


def _new_assigner(args: list[str]) -> int:
    from pathlib import Path

    from gearlab.credit.scaffold import new_assigner

    if len(args) != 1:
        print("gearlab: error: usage: gearlab new-assigner NAME", file=sys.stderr)
        return 2
    try:
        paths = new_assigner(args[0], Path.cwd())
    except (ValueError, FileExistsError) as e:
        print(f"gearlab: error: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(f"wrote {p}")
    print(f"next: edit the formula, then `gearlab check-assigner {args[0]}` and `pytest {paths[2]}`")
    return 0


def _check_assigner(cfg) -> int:
    from gearlab import credit
    from gearlab.config import ConfigError
    from gearlab.credit.contract import check_assigner

    for spec in cfg.assigner.plugins:
        credit.load_module(spec)
    try:
        credit.build(cfg.assigner.base or cfg.assigner.name, dict(cfg.assigner.options))
    except (KeyError, ValueError) as e:
        raise ConfigError(str(e).strip('"')) from None
    checks = check_assigner(cfg.assigner.base or cfg.assigner.name, dict(cfg.assigner.options))
    for c in checks:
        print(f"{'PASS' if c.ok else 'FAIL'}  {c.name}" + (f"  ({c.detail})" if c.detail else ""))
    failed = sum(not c.ok for c in checks)
    print(f"{cfg.assigner.name}: {len(checks) - failed}/{len(checks)} checks passed")
    return 1 if failed else 0


def _report(cfg, explicit_metric: bool = True) -> int:
    from pathlib import Path

    from gearlab.commands.report import build_report
    from gearlab.trainer.tracking import tracking_uri

    try:
        rep = build_report(tracking_uri(cfg), cfg.compare.name, metric=cfg.compare.metric if explicit_metric and cfg.compare.metric != "auto" else None,
                           baseline=cfg.compare.baseline, target=cfg.compare.target, effect=cfg.compare.effect, more_curves=list(cfg.compare.curves),
                           out_dir=Path(cfg.trainer.output_dir) / cfg.compare.name / "report")
    except ValueError as e:
        from gearlab.config import ConfigError

        raise ConfigError(str(e)) from None
    print(rep.table)
    if rep.missing:
        print("missing runs: " + ", ".join(rep.missing))
    print(f"report: {rep.markdown_path}\nplot: {rep.plot_path}")
    return 0


def _replay(cfg) -> int:
    from gearlab.commands.replay import replay

    out = replay(cfg)
    for k, v in out.items():
        print(f"{k}: {v}")
    return 0


def _credit_eval(cfg) -> int:
    from gearlab.commands.credit_eval import credit_eval, markdown

    rec = credit_eval(cfg)
    print(markdown(rec))
    print(f"written: {cfg.credit_eval.out_dir}/credit_eval.json, credit_eval.md, credit_eval.png (MLflow run {rec.get('mlflow_run')})")
    return 0


def _inspect(cfg) -> int:
    from gearlab.commands.inspect import inspect

    out = inspect(cfg)
    for k, v in out.items():
        print(f"{k}: {v}")
    return 0


def _describe_assigner(name: str, overrides: list[str]) -> int:
    """``gearlab assigners NAME``: the method's signals, promises and every option with its type, default and doc."""
    from gearlab import credit
    from gearlab.config import load_config
    from gearlab.credit.options import describe_options

    from gearlab.credit.methods import method_spec

    cfg = load_config(overrides)
    for spec in cfg.assigner.plugins:
        credit.load_module(spec)
    try:
        method = method_spec(name)  # a registered assigner, a variant or a grid point
        cls = credit.get(method.base)
    except (KeyError, ValueError) as e:
        print(f"gearlab: error: {str(e).strip(chr(34))}", file=sys.stderr)
        return 2
    if method.base != name:
        print(f"{name}: a variant of {method.base} with options {method.options}")
    doc = (cls.__doc__ or sys.modules[cls.__module__].__doc__ or "").strip().splitlines()[0]
    promises = [p for p in ("preserves_sign", "preserves_mass", "requires_turns") if getattr(cls, p)]
    print(f"{name}: {doc}")
    print(f"  needs: {', '.join(sorted(str(getattr(s, 'value', s)) for s in cls.needs)) or '-'}"
          f"   promises: {', '.join(promises) or '-'}   docs: docs/credit/")
    rows = describe_options(cls.Options)
    if not rows:
        print("  options: none")
    for opt, tp, default, text in rows:
        print(f"  {opt:22s} {tp:14s} = {default!r:18s} {text}")
    return 0


def _assigners(cfg) -> int:
    from gearlab import credit

    from gearlab.credit.methods import available_methods, method_spec

    for name in credit.available():
        cls = credit.get(name)
        needs = ", ".join(sorted(str(getattr(s, "value", s)) for s in cls.needs)) or "-"
        doc = (cls.__doc__ or sys.modules[cls.__module__].__doc__ or "").strip().splitlines()[0]
        print(f"{name:14s} needs: {needs:30s} {doc}")
    variants = [m for m in available_methods() if method_spec(m).base != m]
    if variants:
        print("variants (conf/assigner/, a base with options; any METHOD:key=value works too):")
        for m in variants:
            spec = method_spec(m)
            print(f"  {m:14s} = {spec.base} {spec.options}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
