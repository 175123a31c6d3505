"""``gearlab credit-eval``: every credit method on the same rollouts, scored against where the response went wrong.

Tasks that can check a solution step by step (``arith``, ``arith_hard``, ``tool_arith``) locate the first wrong step
of a failed response (``Task.locate_error``); its characters are mapped to response tokens. Each method's token
advantages are then scored by ``gearlab.credit.scoring`` (AUROC of blame on the wrong step against the correct
prefix, blame ratio, prefix share, onset precision / recall for segmenting methods), and each raw signal the
methods used (teacher KL, entropy, saliencies; the teacher's surprise −log π_T) by the same AUROC as a detector.

Rollouts: ``credit_eval.rollouts`` names a replay file (``gearlab replay``'s format): read when it exists, else
sampled from the model (``credit_eval.prompts`` × ``rollout.group_size`` responses to test problems) and written
there; "" samples without saving. All methods see the same batch, so their scores are paired.

Writes ``credit_eval.json``, ``credit_eval.md`` (the table) and ``credit_eval.png`` to ``credit_eval.out_dir`` and
logs them to MLflow: to the given run (a training run scoring its final model: artifacts under ``credit_eval/``,
metrics ``credit_eval/<method>/<score>``) or to a new run of the experiment ``credit-eval``.

The same scores are also given on the **reasoning errors** alone (``reasoning_errors`` in the JSON, a second
table): the failed responses whose first wrong step starts before the final-answer span
(gearlab.signals.spans: the last "Answer:" marker, else the last line). A wrong final answer after a correct chain
is trivially "found" by any signal from a teacher that knows the answer; only an earlier error tests whether a
method finds where the reasoning went wrong, and an answer-leak guard (GEAR's ``exclude_answer_span``) can only
help there.

Simplifications: one batch (the scores' n is its number of scorable failed responses, printed with every number);
the scored set is the failed responses with a located error and a non-zero GRPO advantage (a response in a group
where every response failed carries no outcome signal, and plain GRPO gives it no credit to score). Signals are
scored on every failed response with a located error and a correct prefix (the A ≠ 0 condition concerns credit).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from gearlab.config import Config
from gearlab.core.metrics import sanitize_metric_key
from gearlab.credit.scoring import credit_scores, prefix_masks, signal_auroc
from gearlab.rollout.base import SamplingParams
from gearlab.rollout.factory import engine_from_config
from gearlab.signals.spans import answer_positions, locate_errors
from gearlab.tasks.registry import task_from_config
from gearlab.trainer.determinism import deterministic_kernels

SCORES = ("auroc", "blame_ratio", "prefix_share", "onset_precision", "onset_recall")
#: added to the scored methods when ``credit_eval.controls`` is on and GEAR is scored
CONTROLS = ("gear_random", "gear_fixed", "shuffle")


def method_names(cfg: Config, task: Any) -> list[str]:
    """The methods to score: ``credit_eval.assigners`` or every applicable one, plus the controls."""
    from gearlab.commands.inspect import applicable_methods
    from gearlab.credit.methods import available_methods

    names = applicable_methods(task, list(cfg.credit_eval.assigners), "credit_eval.assigners")
    if cfg.credit_eval.controls and any(n == "gear" for n in names):
        known = set(available_methods())
        names += [c for c in CONTROLS if c in known and c not in names]
    return names


def score_batch(rb, names: list[str], res: dict[str, Any], error: torch.Tensor) -> dict[str, Any]:
    """Scores of every method and signal on one batch: {"assigners": {name: scores}, "signals": {name: {...}}}."""
    mask = rb.response_mask
    active = res["seq_adv"] != 0
    out: dict[str, Any] = {"assigners": {}, "signals": {}}
    for name in names:
        onsets = None
        seg = res["segments"].get(name)
        if seg is not None:  # an onset is the first token of a segment
            prev = torch.full_like(seg, -1)
            prev[:, 1:] = seg[:, :-1]
            onsets = (seg >= 0) & (seg != prev)
        out["assigners"][name] = credit_scores(res["credit"][name], mask, error, active, onsets)
    for sig, v in sorted(res["signals"].items()):
        if sig == "teacher_logprobs":  # a low teacher log-prob is the suspicious direction
            sig, v = "teacher_surprise", -v
        auc, n = signal_auroc(v.float(), mask, error)
        out["signals"][sig] = {"auroc": auc, "n": n}
    return out


def reasoning_error_scores(
    rb, names: list[str], res: dict[str, Any], error: torch.Tensor, tokenizer: Any
) -> dict[str, Any]:
    """``score_batch`` restricted to the rows whose located error starts before the final-answer span, with their
    counts: {"n_located": ..., "n_located_informative": ..., "assigners": ..., "signals": ...}."""
    reasoning, _ = answer_positions(tokenizer, rb.response_ids.cpu(), rb.response_mask.cpu())
    first = error.bool() & (error.long().cumsum(dim=1) == 1)  # each row's first error token
    early = (first & reasoning.to(error.device)).any(dim=1)
    err = error & early[:, None]
    located = err.any(dim=1)
    return {"n_located": int(located.sum()), "n_located_informative": int((located & (res["seq_adv"] != 0)).sum()),
            **score_batch(rb, names, res, err)}


def credit_eval(cfg: Config, *, model: Any = None, tokenizer: Any = None, model_name: str | None = None,
                run_id: str | None = None, out_dir: Path | None = None, log: bool = True) -> dict[str, Any]:
    """Run the evaluation (see the module docstring) and return the ``credit_eval.json`` record. With ``model`` the
    given weights are scored (a training run's final model); ``run_id`` logs to that MLflow run. On a card it runs
    with ``trainer.deterministic``'s kernels, as training does, so the same command repeats its scores."""
    with deterministic_kernels(cfg, after="no score was written"):
        return _evaluate(cfg, model, tokenizer, model_name, run_id, out_dir, log)


def _evaluate(cfg: Config, model: Any, tokenizer: Any, model_name: str | None, run_id: str | None,
              out_dir: Path | None, log: bool) -> dict[str, Any]:
    from gearlab.commands.inspect import run_assigners
    from gearlab.commands.replay import cached_rollouts

    task = task_from_config(cfg)
    names = method_names(cfg, task)
    if model is None:
        from gearlab.models.loading import load_for_evaluation

        model, tokenizer, model_name = load_for_evaluation(cfg)
    engine = engine_from_config(tokenizer, task, cfg, model=model)
    path = Path(cfg.credit_eval.rollouts) if cfg.credit_eval.rollouts else None
    rb, problems, info = cached_rollouts(cfg, model, engine, task, path, cfg.credit_eval.prompts, str(model_name))
    G = int(info["group_size"])
    rows = [p for p in problems for _ in range(G)]
    error, _ = locate_errors(task, tokenizer, rb, rows)
    res = run_assigners(rb, names, model=model, tokenizer=tokenizer, engine=engine, problems=problems, group_size=G,
                        sampling=SamplingParams.of_rollout(cfg.rollout), temperature=cfg.rollout.temperature,
                        chunk_size=cfg.signals.chunk_size,
                        micro_batch_size=cfg.algorithm.micro_batch_size, seed=cfg.trainer.seed, task=task)
    _, _, located = prefix_masks(rb.response_mask, error)
    record = {"task": cfg.task.name, "model": model_name, "n_trajectories": rb.batch_size,
              "n_failed": int((rb.rewards < 1 - 1e-6).sum()), "n_failed_located": int(located.sum()),
              "n_located_informative": int((located & (res["seq_adv"] != 0)).sum()),
              **score_batch(rb, names, res, error),
              "reasoning_errors": reasoning_error_scores(rb, names, res, error, tokenizer),
              "assigner_metrics": res["metrics"]}  # each method's own diagnostics on this batch (e.g. gear_clip_frac)
    if cfg.credit_eval.truth in ("mc", "both"):
        from gearlab.commands.credit_eval_mc import mc_truth

        ce = cfg.credit_eval
        record["mc"] = mc_truth(rb, rows, names, res, engine=engine, model=model,
                                sampling=SamplingParams.of_rollout(cfg.rollout), k=ce.mc_k, max_steps=ce.mc_max_steps,
                                seed=cfg.trainer.seed, located=error if bool(located.any()) else None,
                                score_batch=score_batch)
    out = Path(out_dir or cfg.credit_eval.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "credit_eval.json").write_text(json.dumps(record, indent=2, default=_json_nan))
    (out / "credit_eval.md").write_text(markdown(record) + "\n")
    plot(record, out / "credit_eval.png")
    if log:
        _log(cfg, record, out, run_id)
    return record


def after_training(cfg: Config, result: Any) -> dict[str, Any] | None:
    """``credit_eval.after_training``: score a finished training run's final model (``<run>/final``) on rollouts of its
    own, written to ``<run>/credit_eval/`` and logged to its MLflow run (``credit_eval/`` artifacts). None when the
    option is off, the run did not finish, or the task cannot locate errors."""
    from gearlab.tasks.base import Task

    final = Path(result.run_dir) / "final"
    if not cfg.credit_eval.after_training or result.stopped_early or not (final / "config.json").is_file():
        return None
    task = task_from_config(cfg)
    if type(task).locate_error is Task.locate_error:
        print(f"[credit-eval] task {cfg.task.name!r} cannot locate errors: skipped", flush=True)
        return None
    from omegaconf import OmegaConf

    from gearlab.models.loading import load_for_evaluation

    # on the run's GPU when it had one (a comparison's children scored on the CPU took ~15 min each beside the card)
    sub = OmegaConf.merge(cfg, {"model": {"name_or_path": str(final)}, "eval": {"checkpoint": None}})
    model, tok, _ = load_for_evaluation(sub)
    return credit_eval(sub, model=model, tokenizer=tok, model_name=f"{cfg.trainer.run_name or final.parent.name}/final",
                       run_id=result.mlflow_run_id or None, out_dir=Path(result.run_dir) / "credit_eval",
                       log=bool(result.mlflow_run_id))


def _json_nan(x: Any) -> Any:
    return None if isinstance(x, float) and math.isnan(x) else str(x)


def _num(v: Any, digits: int = 3) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def markdown(record: dict[str, Any]) -> str:
    """The credit-eval table of one record (one batch: no intervals)."""
    head = (f"credit vs known errors — task {record['task']}, {record['n_trajectories']} responses, "
            f"{record['n_failed_located']} failed with a located error, {record.get('n_located_informative', '?')} of "
            f"them with A ≠ 0 (scored)\n\n"
            "| method | AUROC (0.5 = uniform) | blame ratio (1 = uniform) | prefix share | onset P | onset R | n |\n"
            "|---|---|---|---|---|---|---|")
    lines = [head]
    for name, s in record["assigners"].items():
        lines.append(f"| {name} | {_num(s.get('auroc'))} | {_num(s.get('blame_ratio'))} | "
                     f"{_num(s.get('prefix_share'))} | "
                     f"{_num(s.get('onset_precision'))} | {_num(s.get('onset_recall'))} | {s.get('n', 0)} |")
    for name, s in record["signals"].items():
        lines.append(f"| signal: {name} | {_num(s.get('auroc'))} | | | | | {s.get('n', 0)} |")
    early = record.get("reasoning_errors")
    if early:
        lines += ["", f"Errors before the final-answer span only ({early['n_located_informative']} scored):", "",
                  "| method | AUROC | blame ratio | prefix share | onset P | onset R | n |",
                  "|---|---|---|---|---|---|---|"]
        for name, s in early["assigners"].items():
            lines.append(f"| {name} | {_num(s.get('auroc'))} | {_num(s.get('blame_ratio'))} | "
                         f"{_num(s.get('prefix_share'))} | "
                         f"{_num(s.get('onset_precision'))} | {_num(s.get('onset_recall'))} | {s.get('n', 0)} |")
        for name, s in early["signals"].items():
            lines.append(f"| signal: {name} | {_num(s.get('auroc'))} | | | | | {s.get('n', 0)} |")
    if record.get("mc"):
        from gearlab.commands.credit_eval_mc import markdown as mc_markdown

        lines += ["", mc_markdown(record["mc"], _num)]
    clip = {n: m["gear_clip_frac"] for n, m in (record.get("assigner_metrics") or {}).items() if "gear_clip_frac" in m}
    if clip:
        lines.append(
            "\nSegment weights at a bound (`gear_clip_frac`): " + ", ".join(f"{n} {v:.3f}" for n, v in clip.items())
        )
    return "\n".join(lines)


def plot(record: dict[str, Any], path: Path) -> None:
    """Two panels: AUROC of every method and signal (0.5 = no information), blame ratio of every method (1 = GRPO)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def val(x: Any) -> float:
        return float("nan") if x is None else float(x)

    names = list(record["assigners"]) + [f"signal: {s}" for s in record["signals"]]
    au = [
        val(s.get("auroc")) for s in record["assigners"].values()
    ] + [val(s.get("auroc")) for s in record["signals"].values()]
    br = [val(s.get("blame_ratio")) for s in record["assigners"].values()]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 0.35 * len(names) + 1.8))
    a1.barh(range(len(names)), [0 if math.isnan(v) else v - 0.5 for v in au], left=0.5,
            color=["C0"] * len(record["assigners"]) + ["C2"] * len(record["signals"]))
    for i, v in enumerate(au):
        a1.text(0.98, i, _num(v), va="center", ha="right", fontsize=7)
    a1.axvline(0.5, color="k", lw=0.8)
    a1.set_yticks(range(len(names)), names, fontsize=8)
    a1.set_xlim(0, 1)
    a1.invert_yaxis()
    a1.set_title("AUROC: blame on the first wrong step vs the correct prefix (0.5 = uniform)", fontsize=8)
    m = list(record["assigners"])
    a2.barh(range(len(m)), [0 if math.isnan(v) else v - 1 for v in br], left=1, color="C1")
    for i, v in enumerate(br):
        a2.text(1.0, i, " " + _num(v), va="center", ha="left", fontsize=7)
    a2.axvline(1, color="k", lw=0.8)
    a2.set_yticks(range(len(m)), m, fontsize=8)
    a2.invert_yaxis()
    a2.set_title("blame ratio: per-token blame from the wrong step on / on the prefix (1 = uniform)", fontsize=8)
    fig.suptitle(f"{record['task']}: {record.get('n_located_informative', 0)} scored failed responses", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def metrics_of(record: dict[str, Any]) -> dict[str, float]:
    """MLflow metrics ``credit_eval/<method>/<score>`` and ``credit_eval/signal/<name>/auroc`` (NaN left out)."""
    out: dict[str, float] = {}
    for name, s in record["assigners"].items():
        for k in SCORES:
            v = s.get(k)
            if isinstance(v, float) and not math.isnan(v):
                out[sanitize_metric_key(f"credit_eval/{name}/{k}")] = v
    for name, s in record["signals"].items():
        v = s.get("auroc")
        if isinstance(v, float) and not math.isnan(v):
            out[sanitize_metric_key(f"credit_eval/signal/{name}/auroc")] = v
    out["credit_eval/n_located_informative"] = float(record.get("n_located_informative", 0))
    return out


def _log(cfg: Config, record: dict[str, Any], out: Path, run_id: str | None) -> None:
    import time

    import mlflow
    from mlflow.entities import Metric

    from gearlab.trainer.tracking import ensure_experiment, tracking_uri

    client = mlflow.MlflowClient(tracking_uri(cfg))
    own = run_id is None
    if own:
        exp_id = ensure_experiment(tracking_uri(cfg), "credit-eval", client)
        run_id = client.create_run(exp_id, run_name=f"{cfg.task.name}", tags={
            "model": str(record["model"]), "task": cfg.task.name,
            "assigners": ",".join(record["assigners"])}).info.run_id
    now = int(time.time() * 1000)
    items = [Metric(k, v, now, 0) for k, v in metrics_of(record).items()]
    for s in range(0, len(items), 1000):
        client.log_batch(run_id, metrics=items[s: s + 1000])
    for f in ("credit_eval.json", "credit_eval.md", "credit_eval.png"):
        client.log_artifact(run_id, str(out / f), "credit_eval")
    if own:
        client.set_terminated(run_id)
    record["mlflow_run"] = run_id
