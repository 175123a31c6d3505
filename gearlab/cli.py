"""``gearlab`` command line: warmstart, train, eval, assigners, check-assigner, new-assigner, inspect, compare,
report, credit-eval, replay and export (``gearlab --help`` says what each does).

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
      warmstart   supervised warm start on the task's demonstrations: the embedded tiny model from scratch, or a
                  pretrained model (model.name_or_path) fine-tuned into runs/warmstart/
      train       GRPO training; the credit method is `assigner=NAME`
      eval        greedy accuracy and pass@k of a model or checkpoint on a task's test split
      assigners [NAME]  list the registered credit assigners; with NAME: its options, defaults and docs
      check-assigner NAME [overrides]   run the contract kit on a credit method (exit 1 if it fails)
      new-assigner NAME                 run in a gearlab checkout: write assigners/NAME.py, conf/assigner/NAME.yaml
                                        and tests/assigners/test_NAME.py; run in any other folder (e.g. gearlab
                                        installed from a wheel): a plug-in there, ./NAME.py, ./conf/assigner/NAME.yaml
                                        and ./tests/test_NAME.py (use it with assigner.plugins=[NAME.py])
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

    gearlab <command> --help lists the config keys that command reads (type, default, doc);
    gearlab <command> [overrides ...] --print-config prints the resolved config as YAML and runs nothing.
    """)

# The config sections each command reads: `gearlab <command> --help` lists their keys. The embedded tiny model is
# warm-started on first use, so every command that loads a model also reads warmstart.
_TRAIN_SECTIONS = ("model", "task", "rollout", "algorithm", "assigner", "optim", "signals", "trainer", "logging",
                   "eval", "credit_eval", "warmstart")
_EVAL_SECTIONS = ("model", "task", "rollout", "algorithm", "signals", "trainer", "logging", "eval", "warmstart")
COMMAND_SECTIONS: dict[str, tuple[str, ...]] = {
    "warmstart": ("warmstart", "model", "task", "trainer"),
    "train": _TRAIN_SECTIONS,
    "eval": ("model", "task", "rollout", "eval", "trainer", "warmstart"),
    "assigners": ("assigner",),
    "check-assigner": ("assigner",),
    "new-assigner": (),
    "inspect": (*_EVAL_SECTIONS, "inspect"),
    "compare": (*_TRAIN_SECTIONS, "compare"),
    "report": ("compare", "logging", "trainer"),
    "credit-eval": (*_EVAL_SECTIONS, "credit_eval"),
    "replay": (*_EVAL_SECTIONS, "replay"),
    "export": ("export", "model"),
}


def command_help(cmd: str) -> str:
    """``gearlab <cmd> --help``: the command's line of the global help and every config key it reads, with type,
    default and doc (gearlab.config_help)."""
    from gearlab.config_help import format_sections

    lines = HELP.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith(f"  {cmd} "))
    end = next(i for i in range(first + 1, len(lines)) if not lines[i].startswith(" " * 4))  # its continuation lines
    sections = COMMAND_SECTIONS[cmd]
    args = {"assigners": " [NAME]", "check-assigner": " NAME", "report": " NAME", "new-assigner": " NAME"}.get(cmd, "")
    out = [f"usage: gearlab {cmd}{args}" + (" [overrides ...] [--print-config]" if sections else ""), "",
           *lines[first:end], ""]
    if not sections:
        return "\n".join(out)
    out += ["overrides: group=NAME picks conf/<group>/NAME.yaml (assigner, task, model, experiment; experiment first);",
            "section.key=value sets one key. --print-config prints the resolved config as YAML and runs nothing.",
            "", "config keys (key  type = default  doc):", "", format_sections(sections)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Run one ``gearlab`` command; returns its exit code (0, 1 for a failed check or child, 2 for bad input,
    128 + the signal when stopped)."""
    try:
        return _main(argv)
    except BrokenPipeError:  # `gearlab assigners | head`: the reader left early, which is not gearlab's error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the interpreter's last flush succeeds
        return 141  # 128 + SIGPIPE, as the shell reports a process its pipe closed


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(HELP)
        return 0
    cmd, overrides = argv[0], argv[1:]
    if any(a in ("-h", "--help") for a in overrides):
        print(command_help(cmd) if cmd in COMMAND_SECTIONS else HELP)
        return 0
    print_config = "--print-config" in overrides
    overrides = [o for o in overrides if o != "--print-config"]
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # the report reads many small artifacts
    from gearlab.config import ConfigError, load_config
    from gearlab.stopping import Stopped

    early, overrides = _positional(cmd, overrides, print_config)
    if early is not None:
        return early
    from gearlab.commands.assigners import check_assigner_command, list_assigners

    commands = {"train": _train, "warmstart": _warmstart, "eval": _eval, "assigners": list_assigners,
                "check-assigner": check_assigner_command, "inspect": _inspect, "compare": None, "report": _report,
                "replay": _replay, "credit-eval": _credit_eval, "export": _export}
    if cmd not in commands:
        print(f"gearlab: error: unknown command {cmd!r}; commands: {', '.join(commands)}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(overrides)
        if print_config:
            from gearlab.config import to_yaml

            print(to_yaml(cfg), end="")
            return 0
        if cmd != "train":  # train quiets after its own checks (_train)
            _quiet()  # after the config's checks: it imports Lightning (seconds), which bad input need not wait for
        if cmd == "compare":
            return _compare(cfg, overrides)
        if cmd == "report":  # the metric the comparison named before it ran, unless one is asked for here
            return _report(cfg, explicit_metric=any(o.startswith("compare.metric=") for o in overrides))
        return commands[cmd](cfg)
    except ConfigError as e:
        print(f"gearlab: error: {e}", file=sys.stderr)
        return 2
    except Stopped as e:  # a stop request during work that keeps nothing partial (a warm start)
        print(f"gearlab: {e}: the same command starts it again", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:  # Ctrl-C twice (past the clean stop of train / compare), or in a command without one
        print("gearlab: aborted (Ctrl-C); a training run keeps its last checkpoint: the same command resumes it",
              file=sys.stderr)
        return 130


def _positional(cmd: str, overrides: list[str], print_config: bool) -> tuple[int | None, list[str]]:
    """The commands' positional arguments made overrides (``report NAME``, ``check-assigner NAME``, ``assigners
    NAME``, compare's short forms). Returns (an exit code when the command is done or misused, else None; the
    overrides)."""
    if cmd == "new-assigner":
        if print_config:
            print("gearlab: error: new-assigner reads no config (usage: gearlab new-assigner NAME)", file=sys.stderr)
            return 2, overrides
        from gearlab.commands.assigners import new_assigner_command

        return new_assigner_command(overrides), overrides
    if cmd == "report":
        if not overrides or "=" in overrides[0]:
            print("gearlab: error: usage: gearlab report COMPARISON [compare.metric=...] [compare.target=0.5]",
                  file=sys.stderr)
            return 2, overrides
        return None, [f"compare.name={overrides[0]}", *overrides[1:]]
    if cmd == "assigners" and overrides and "=" not in overrides[0]:
        if not print_config:
            from gearlab.commands.assigners import describe_assigner

            return describe_assigner(overrides[0], overrides[1:]), overrides
        return None, overrides[1:]  # NAME only picks what to describe; the config is the rest
    if cmd == "compare":  # short forms: assigners=[...] seeds=[...] workers=N
        short = {"assigners": "compare.assigners", "seeds": "compare.seeds", "workers": "compare.workers",
                 "name": "compare.name"}
        return None, [f"{short[o.split('=', 1)[0]]}={o.split('=', 1)[1]}" if o.split("=", 1)[0] in short else o
                      for o in overrides]
    if cmd == "check-assigner":
        if not overrides or "=" in overrides[0]:
            print("gearlab: error: usage: gearlab check-assigner NAME [overrides]", file=sys.stderr)
            return 2, overrides
        return None, [f"assigner={overrides[0]}", *overrides[1:]]
    return None, overrides


def _compare(cfg, overrides: list[str]) -> int:
    """``gearlab compare``: run (or resume) the comparison, print its summary and table. Exit 0, 1 if a child
    failed, 128 + the signal when stopped (130 for a compare.max_minutes stop)."""
    from gearlab.commands.compare import compare

    base = [o for o in overrides if not o.startswith(("compare.", "assigner=", "assigner.name=", "assigner.base="))]
    res = compare(cfg, base)
    if res.get("interrupted"):
        return 128 + res["signal"] if res.get("signal") else 130
    from gearlab.commands.closing import compare_summary

    print(compare_summary(cfg))
    print("\n" + res["table"])  # last: the paired table, the credit-eval table, the learning and power lines
    return 1 if res["failed"] else 0


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


def _train(cfg) -> int:
    from gearlab.trainer.preflight import preflight

    checked = preflight(cfg)  # task, model path, assigner options: a bad one exits before Lightning's import
    _quiet()
    from gearlab.parallel.distributed import leave_process_group
    from gearlab.trainer.train import train

    res = train(cfg, checked)
    leave_process_group()
    if res.already_finished:  # nothing done, nothing changed
        from gearlab.trainer.resume import finished_message
        from gearlab.trainer.train import _is_launch_rank_zero

        if _is_launch_rank_zero():  # (every process of a multi-process launch finds it finished)
            print(finished_message(res.run_dir, res.iterations_done))
        return 0
    code = 128 + res.stop_signal if res.stopped_early and res.stop_signal else 0  # 130 Ctrl-C, 143 SIGTERM
    if not res.mlflow_run_id:  # not global rank 0 of a multi-process run: rank 0 reports
        return code
    if cfg.credit_eval.after_training:
        from gearlab.commands.credit_eval import after_training, markdown

        rec = after_training(cfg, res)
        if rec is not None:
            print(markdown(rec))
    from gearlab.commands.closing import train_summary

    print(train_summary(res, sys.argv[1:] if sys.argv[1:2] == ["train"] else ["train"], cfg))
    return code


def _warmstart(cfg) -> int:
    from gearlab.config import check_output_dir
    from gearlab.models.loading import run_warmstart, warmstart_dir

    check_output_dir(cfg)
    out = run_warmstart(cfg, shipped=False)  # the command recomputes what the package ships
    print(json.dumps(out, indent=2, default=str))
    print(f"warm-started model: {warmstart_dir(cfg)}")
    return 0


def _eval(cfg) -> int:
    from gearlab.commands.evaluate import evaluate

    res = evaluate(cfg)
    print(json.dumps(res, indent=2))
    return 0


def _report(cfg, explicit_metric: bool = True) -> int:
    from pathlib import Path

    from gearlab.commands.report import build_report
    from gearlab.trainer.tracking import check_tracking_uri, tracking_uri

    check_tracking_uri(cfg)
    try:
        rep = build_report(tracking_uri(cfg), cfg.compare.name,
                           metric=cfg.compare.metric if explicit_metric and cfg.compare.metric != "auto" else None,
                           baseline=cfg.compare.baseline, target=cfg.compare.target, effect=cfg.compare.effect,
                           more_curves=list(cfg.compare.curves),
                           out_dir=Path(cfg.trainer.output_dir) / cfg.compare.name / "report")
    except ValueError as e:
        from gearlab.config import ConfigError

        raise ConfigError(str(e)) from None
    print(rep.table)
    if rep.missing:
        print("missing runs: " + ", ".join(rep.missing))
    print(f"report: {rep.markdown_path}\nplot: {rep.plot_path}")
    from gearlab.commands.closing import experiment_id, mlflow_ui_command

    exp_id = experiment_id(tracking_uri(cfg), name=f"compare/{cfg.compare.name}")
    print(f"in MLflow (the report is the parent run's description): {mlflow_ui_command(tracking_uri(cfg), exp_id)}")
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
    print(
        f"written: {cfg.credit_eval.out_dir}/credit_eval.json, credit_eval.md, credit_eval.png (MLflow run "
        f"{rec.get('mlflow_run')})"
    )
    return 0


def _inspect(cfg) -> int:
    from gearlab.commands.inspect import inspect

    out = inspect(cfg)
    for k, v in out.items():
        print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
