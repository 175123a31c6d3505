"""``gearlab inspect``: one sampled batch, several credit assigners, one picture.

Samples ``inspect.prompts × rollout.group_size`` responses from a model (or checkpoint), runs each
assigner on that SAME batch and writes
  credit.json  — per sample (batch order): tokens, response_mask, turn_ids, reward, seq_advantage,
                 informative, credit {assigner: [A_t]}, signals {name: [..]}, segments {assigner: [segment id]};
                 plus "order", the sample indices in the order the pictures show them (``display_order``)
  credit.html  — self-contained page: tokens coloured by credit, one row per assigner; samples with
                 no GRPO signal (A = 0) folded away at the end
  credit.png   — heat map rows per assigner + KL / entropy traces, GEAR segments outlined, colour bar;
                 the first panels are the most informative samples

``inspect.shared_scale`` puts every row of both pictures on one colour scale (global max |A|), so
methods can be compared by magnitude; by default each row is scaled to its own max |A| (shape only).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from gearlab import credit
from gearlab.core.batch import RolloutBatch
from gearlab.commands.credit_pictures import credit_html, credit_png, display_order, informative
from gearlab.config import Config, ConfigError
from gearlab.credit import Signal
from gearlab.credit.methods import available_methods, build_method, unknown_methods
from gearlab.core.grpo import group_advantages
from gearlab.rollout.hf import HFRolloutEngine
from gearlab.rollout.base import SamplingParams
from gearlab.rollout.mc import resampler_of_groups
from gearlab.signals.registry import needs_resampler
from gearlab.rollout.factory import engine_from_config
from gearlab.signals.provider import SignalProvider
from gearlab.tasks.registry import task_from_config
from gearlab.trainer.teacher import needs_teacher

TRACE_SIGNALS = {Signal.TEACHER_KL: "kl", Signal.ENTROPY: "entropy", Signal.TEACHER_LOGPROBS: "teacher_logprobs",
                 Signal.INPUT_GRAD_SALIENCY: "input_grad_saliency",
                 Signal.PERTURBATION_SALIENCY: "perturbation_saliency"}


def applicable_methods(task: Any, names: list[str] | None = None, key: str = "inspect.assigners") -> list[str]:
    """``names`` checked (variants and grid points included), or every registered assigner that applies to the task
    (turn methods only on multi-turn tasks). ConfigError naming ``key`` for an unknown method."""
    if names:
        bad = unknown_methods(names)
        if bad:
            raise ConfigError(f"key '{key}': unknown {bad}; known: {', '.join(available_methods())}")
        return list(names)
    return [n for n in credit.available() if _applies(n, task)]


def _applies(name: str, task: Any) -> bool:
    """Whether a registered method belongs in a default method list for ``task``: turn methods need a multi-turn
    task, a method's ``setup`` may refuse a task (vineppo: single-turn only), and methods that sample extra rollouts
    run only when named."""
    cls = credit.get(name)
    if cls.extra_rollouts or (cls.requires_turns and not getattr(task, "multi_turn", False)):
        return False
    try:
        build_method(name).setup(seed=0, total_steps=1, task=task)
    except ValueError:
        return False
    return True


def run_assigners(rb: RolloutBatch, names: list[str], *, model, tokenizer, engine: HFRolloutEngine, problems,
                  group_size: int, sampling: SamplingParams,
                  temperature: float, chunk_size: int, micro_batch_size: int, seed: int, task) -> dict[str, Any]:
    """Credit of every assigner on the same batch (shared signal computations cached per teacher context).
    ``sampling``: what the batch was drawn with; Monte-Carlo signals continue its responses with it."""
    dev = next(model.parameters()).device  # computed where the model is (a GPU's), returned on the CPU
    rb = rb.to(dev)
    seq_adv = group_advantages(rb.rewards, rb.group_ids)
    provider = SignalProvider(model, temperature=temperature, chunk_size=chunk_size, micro_batch_size=micro_batch_size,
                              tokenizer=tokenizer)
    cache: dict[tuple[str, Signal, tuple], torch.Tensor] = {}
    out: dict[str, Any] = {"seq_adv": seq_adv.cpu(), "credit": {}, "signals": {}, "segments": {}, "metrics": {}}
    for name in names:
        a = build_method(name)
        a.setup(seed=seed, total_steps=1, task=task)
        ctx = a.teacher_context if needs_teacher(a) else "none"
        batch = rb
        if ctx == "sibling":  # each row's own teacher prompt, with a correct response of its group (sdpo)
            rows = [p for p in problems for _ in range(group_size)]
            tids, tmask = engine.encode_sibling_prompts(rows, rb.meta["texts"], rb.rewards, rb.group_ids)
            batch = rb.with_(teacher_prompt_ids=tids.to(dev), teacher_prompt_mask=tmask.to(dev))
        elif ctx != "none":
            tids, tmask = engine.encode_prompts(problems, privileged=ctx)
            batch = rb.with_(teacher_prompt_ids=tids.repeat_interleave(group_size, 0).to(dev),
                             teacher_prompt_mask=tmask.repeat_interleave(group_size, 0).to(dev))
        # a signal computed with other options (e.g. shear's span length, OAR's pfinal_mode) is another signal
        opts = tuple(sorted((k, repr(v)) for k, v in a.signal_options().items()))
        todo = frozenset(s for s in a.needs if (ctx, s, opts) not in cache)
        if todo:
            resampler = (resampler_of_groups(engine, model, rb, problems, group_size, sampling)
                         if needs_resampler(todo) else None)
            _, sig = provider.compute(batch, todo, with_logprobs=False, options={"seed": seed, **a.signal_options()},
                                      resampler=resampler)
            cache.update({(ctx, s, opts): v for s, v in sig.items()})
        res = a.assign(batch, seq_adv, {s: cache[(ctx, s, opts)] for s in a.needs})
        adv = res.token_advantages.float()
        if res.loss_mask is not None:  # tokens outside the loss mask get no gradient: their effective credit is 0
            adv = adv * (res.loss_mask.bool() & batch.response_mask).float()
        out["credit"][name] = adv.cpu()
        out["metrics"][name] = {k: float(v) for k, v in res.metrics.items()}
        if getattr(a, "last_segments", None) is not None:
            out["segments"][name] = a.last_segments.cpu()
    for (ctx, s, _), v in cache.items():
        if s in TRACE_SIGNALS:
            out["signals"][TRACE_SIGNALS[s]] = v.cpu()
    return out


def inspect(cfg: Config) -> dict[str, str]:
    from gearlab.models.loading import load_for_evaluation

    task = task_from_config(cfg)
    names = applicable_methods(task, list(cfg.inspect.assigners))
    model, tok, model_name = load_for_evaluation(cfg)
    G = cfg.rollout.group_size
    problems = task.problems("test", cfg.inspect.prompts, cfg.trainer.seed)
    engine = engine_from_config(tok, task, cfg, model=model)
    sampling = SamplingParams.of_rollout(cfg.rollout)
    rb = engine.generate(model, problems, group_size=G, sampling=sampling, seed=cfg.trainer.seed)
    res = run_assigners(rb, names, model=model, tokenizer=tok, engine=engine, problems=problems, group_size=G,
                        sampling=sampling,
                        temperature=cfg.rollout.temperature, chunk_size=cfg.signals.chunk_size,
                        micro_batch_size=cfg.algorithm.micro_batch_size, seed=cfg.trainer.seed, task=task)
    out = Path(cfg.inspect.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = _records(rb, res, tok, names, model_name, cfg)
    (out / "credit.json").write_text(json.dumps(records, indent=1))
    shared = bool(cfg.inspect.shared_scale)
    (out / "credit.html").write_text(credit_html(records, shared_scale=shared))
    credit_png(records, out / "credit.png", shared_scale=shared)
    return {"json": str(out / "credit.json"), "html": str(out / "credit.html"), "png": str(out / "credit.png"),
            "assigners": ", ".join(names)}


#: keys of a run, besides ``task.*``, that ``gearlab inspect`` must share with it to sample the same kind of batch
#: (group size, lengths, turns, sampling) and to load and score it the same way (dtype, plug-ins, memory per pass)
INSPECT_KEYS = ("rollout.group_size", "rollout.max_new_tokens", "rollout.temperature", "rollout.top_p", "rollout.top_k",
                "rollout.max_turns", "rollout.max_total_tokens", "model.dtype", "model.trust_remote_code",
                "algorithm.micro_batch_size", "signals.chunk_size", "assigner.plugins")


def inspect_command(cfg: Config, model_path: str | Path) -> str:
    """The ``gearlab inspect`` command line that looks at the credit of a model trained under ``cfg``: its task
    (``task=NAME``, or ``task.name=NAME`` when there is no conf/task/NAME.yaml), every task option and
    :data:`INSPECT_KEYS` value that differs from what that command would get by default, and ``model_path``.
    Each word is shell-quoted where needed, so the line can be pasted as printed."""
    import shlex

    import yaml
    from omegaconf import OmegaConf

    from gearlab.config import load_config

    name = cfg.task.name
    head = [f"task={name}"]
    try:
        base = load_config(head)
        if base.task.name != name:  # a YAML that names another task: say the name itself
            raise ConfigError(name)
    except ConfigError:
        head = [f"task.name={name}"]
        base = load_config(head)

    def value(v: Any) -> str:
        if v is None:
            return "null"
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (list, tuple)):
            return "[" + ",".join(value(x) for x in v) + "]"
        if isinstance(v, str) and not isinstance(yaml.safe_load(v) if v else "", str):
            return f'"{v}"'  # "1", "true", "null" stay strings
        return str(v)

    words = [*head, f"model.name_or_path={model_path}"]

    def diff(key: str, mine: Any, theirs: Any) -> None:
        if isinstance(mine, dict):
            for k in sorted(mine):
                diff(f"{key}.{k}", mine[k], theirs.get(k) if isinstance(theirs, dict) else None)
        elif mine != theirs:
            words.append(f"{key}={value(mine)}")

    mine_task, base_task = OmegaConf.to_container(cfg.task), OmegaConf.to_container(base.task)
    diff("task.options", mine_task["options"], base_task["options"])
    diff("task.plugins", mine_task["plugins"], base_task["plugins"])
    for key in INSPECT_KEYS:
        mine, theirs = OmegaConf.select(cfg, key), OmegaConf.select(base, key)
        mine = OmegaConf.to_container(mine) if OmegaConf.is_config(mine) else mine
        theirs = OmegaConf.to_container(theirs) if OmegaConf.is_config(theirs) else theirs
        diff(key, mine, theirs)
    return "gearlab inspect " + " ".join(shlex.quote(w) for w in words)


def _records(
    rb: RolloutBatch, res: dict[str, Any], tok, names: list[str], model_name: str, cfg: Config
) -> dict[str, Any]:
    """The JSON record: every sample in batch order (a data file), plus the display order of the pictures."""
    samples = []
    for i in range(rb.batch_size):
        n = int(rb.attention_mask[i].sum())
        ids = rb.response_ids[i, :n].tolist()
        samples.append({
            "prompt": tok.decode(rb.prompt_ids[i][rb.prompt_mask[i].bool()].tolist()),
            "tokens": [tok.decode([t]) for t in ids],
            "response_mask": rb.response_mask[i, :n].int().tolist(),
            "turn_ids": rb.turn_ids[i, :n].tolist() if rb.turn_ids is not None else [0] * n,
            "group": int(rb.group_ids[i]), "reward": float(rb.rewards[i]), "seq_advantage": float(res["seq_adv"][i]),
            "credit": {a: [round(v, 6) for v in res["credit"][a][i, :n].tolist()] for a in names},
            "signals": {k: [round(v, 6) for v in t[i, :n].tolist()] for k, t in res["signals"].items()},
            "segments": {a: s[i, :n].tolist() for a, s in res["segments"].items()},
        })
        samples[-1]["informative"] = informative(samples[-1])
        if rb.turn_rewards is not None:  # multi-turn: per-turn rewards (NaN = turn did not happen → dropped)
            samples[-1]["turn_rewards"] = [float(v) for v in rb.turn_rewards[i].tolist() if v == v]
            samples[-1]["end_reason"] = (rb.meta.get("end_reasons") or [None] * rb.batch_size)[i]
    return {"model": model_name, "task": cfg.task.name, "assigners": names, "metrics": res["metrics"],
            "order": display_order(samples), "samples": samples}

