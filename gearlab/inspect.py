"""``gearlab inspect``: one sampled batch, several credit assigners, one picture.

Samples ``inspect.prompts × rollout.group_size`` responses from a model (or checkpoint), runs each
assigner on that SAME batch and writes
  credit.json  — per sample: tokens, response_mask, turn_ids, reward, seq_advantage,
                 credit {assigner: [A_t]}, signals {name: [..]}, segments {assigner: [segment id]}
  credit.html  — self-contained page: tokens coloured by credit, one row per assigner
  credit.png   — heat map rows per assigner + KL / entropy traces, GEAR segments shaded
"""
from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from gearlab import credit
from gearlab.batch import RolloutBatch
from gearlab.config import Config, ConfigError, conf_dir
from gearlab.credit import Signal
from gearlab.grpo import group_advantages
from gearlab.rollout import HFRolloutEngine, SamplingParams, engine_from_config
from gearlab.signals import SignalProvider
from gearlab.tasks.base import get_task
from gearlab.teacher import needs_teacher

TRACE_SIGNALS = {Signal.TEACHER_KL: "kl", Signal.ENTROPY: "entropy", Signal.TEACHER_LOGPROBS: "teacher_logprobs",
                 Signal.INPUT_GRAD_SALIENCY: "input_grad_saliency", Signal.PERTURBATION_SALIENCY: "perturbation_saliency"}


def assigner_options(name: str) -> dict[str, Any]:
    """The options of conf/assigner/<name>.yaml, or {} for a plug-in without one."""
    path = conf_dir() / "assigner" / f"{name}.yaml"
    return dict(OmegaConf.to_container(OmegaConf.load(path)).get("options") or {}) if path.is_file() else {}


def run_assigners(rb: RolloutBatch, names: list[str], *, model, tokenizer, engine: HFRolloutEngine, problems, group_size: int,
                  temperature: float, chunk_size: int, micro_batch_size: int, seed: int, task) -> dict[str, Any]:
    """Credit of every assigner on the same batch (shared signal computations cached per teacher context)."""
    seq_adv = group_advantages(rb.rewards, rb.group_ids)
    provider = SignalProvider(model, temperature=temperature, chunk_size=chunk_size, micro_batch_size=micro_batch_size,
                              tokenizer=tokenizer)
    cache: dict[tuple[str, Signal], torch.Tensor] = {}
    out: dict[str, Any] = {"seq_adv": seq_adv, "credit": {}, "signals": {}, "segments": {}, "metrics": {}}
    for name in names:
        a = credit.build(name, assigner_options(name))
        a.setup(seed=seed, total_steps=1, task=task)
        ctx = a.teacher_context if needs_teacher(a) else "none"
        batch = rb
        if ctx != "none":
            tids, tmask = engine.encode_prompts(problems, privileged=ctx)
            batch = rb.with_(teacher_prompt_ids=tids.repeat_interleave(group_size, 0),
                             teacher_prompt_mask=tmask.repeat_interleave(group_size, 0))
        todo = frozenset(s for s in a.needs if (ctx, s) not in cache)
        if todo:
            _, sig = provider.compute(batch, todo, with_logprobs=False, options={"seed": seed, **a.signal_options()})
            cache.update({(ctx, s): v for s, v in sig.items()})
        res = a.assign(batch, seq_adv, {s: cache[(ctx, s)] for s in a.needs})
        adv = res.token_advantages.float()
        if res.loss_mask is not None:  # tokens outside the loss mask get no gradient: their effective credit is 0
            adv = adv * (res.loss_mask.bool() & batch.response_mask).float()
        out["credit"][name] = adv
        out["metrics"][name] = {k: float(v) for k, v in res.metrics.items()}
        if getattr(a, "last_segments", None) is not None:
            out["segments"][name] = a.last_segments
    for (ctx, s), v in cache.items():
        if s in TRACE_SIGNALS:
            out["signals"][TRACE_SIGNALS[s]] = v
    return out


def inspect(cfg: Config) -> dict[str, str]:
    from gearlab.evaluate import _load

    task = get_task(cfg.task.name, **dict(cfg.task.options))
    names = list(cfg.inspect.assigners) or [n for n in credit.available()
                                            if not credit.get(n).requires_turns or getattr(task, "multi_turn", False)]
    unknown = [n for n in names if n not in credit.available()]
    if unknown:
        raise ConfigError(f"key 'inspect.assigners': unknown {unknown}; known: {', '.join(credit.available())}")
    model, tok, model_name = _load(cfg)
    G = cfg.rollout.group_size
    problems = task.problems("test", cfg.inspect.prompts, cfg.trainer.seed)
    engine = engine_from_config(tok, task, cfg)
    sampling = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                              top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)
    rb = engine.generate(model, problems, group_size=G, sampling=sampling, seed=cfg.trainer.seed)
    res = run_assigners(rb, names, model=model, tokenizer=tok, engine=engine, problems=problems, group_size=G,
                        temperature=cfg.rollout.temperature, chunk_size=cfg.signals.chunk_size,
                        micro_batch_size=cfg.algorithm.micro_batch_size, seed=cfg.trainer.seed, task=task)
    out = Path(cfg.inspect.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = _records(rb, res, tok, names, model_name, cfg)
    (out / "credit.json").write_text(json.dumps(records, indent=1))
    (out / "credit.html").write_text(_html(records))
    _png(records, out / "credit.png")
    return {"json": str(out / "credit.json"), "html": str(out / "credit.html"), "png": str(out / "credit.png"),
            "assigners": ", ".join(names)}


def _records(rb: RolloutBatch, res: dict[str, Any], tok, names: list[str], model_name: str, cfg: Config) -> dict[str, Any]:
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
        if rb.turn_rewards is not None:  # multi-turn: per-turn rewards (NaN = turn did not happen → dropped)
            samples[-1]["turn_rewards"] = [float(v) for v in rb.turn_rewards[i].tolist() if v == v]
            samples[-1]["end_reason"] = (rb.meta.get("end_reasons") or [None] * rb.batch_size)[i]
    return {"model": model_name, "task": cfg.task.name, "assigners": names, "metrics": res["metrics"], "samples": samples}


def _color(v: float, scale: float) -> str:
    x = max(-1.0, min(1.0, v / scale)) if scale > 0 else 0.0
    return f"rgba(0,140,60,{x:.2f})" if x >= 0 else f"rgba(200,30,30,{-x:.2f})"


def _html(rec: dict[str, Any]) -> str:
    parts = ["<html><head><meta charset='utf-8'><title>gearlab credit</title><style>"
             "body{font-family:sans-serif;margin:20px} td{padding:2px 6px;vertical-align:top} .tok{font-family:monospace;"
             "white-space:pre;padding:1px 0;border-bottom:3px solid transparent} .seg{border-bottom-color:#1f5fbf}"
             "</style></head><body>",
             f"<h2>Credit per token — model {html.escape(rec['model'])}, task {html.escape(rec['task'])}</h2>",
             "<p>Green = positive advantage, red = negative, intensity ∝ |A| / max |A| of the row (each method on its own scale; hover a token for its value); "
             "blue underline = a GEAR segment; grey = not generated by the policy (masked: environment / tool text); "
             "a bar ┃k marks where turn k starts.</p>"]
    for i, s in enumerate(rec["samples"]):
        turns = ""
        if "turn_rewards" in s:
            turns = (f" · {len(s['turn_rewards'])} turn(s), turn rewards "
                     f"[{', '.join(f'{r:.2f}' for r in s['turn_rewards'])}] · ended: {s.get('end_reason')}")
        parts.append(f"<h3>sample {i} · group {s['group']} · reward {s['reward']:.2f} · A = {s['seq_advantage']:+.3f}"
                     f"{html.escape(turns)}</h3><p><i>{html.escape(s['prompt'])}</i></p><table>")
        for a, vals in s["credit"].items():
            seg = s["segments"].get(a)
            scale = max([abs(v) for v in vals] + [1e-9])  # each row on its own scale
            cells = []
            multi = "turn_rewards" in s
            for t, (tokstr, v) in enumerate(zip(s["tokens"], vals)):
                if multi and (t == 0 or s["turn_ids"][t] != s["turn_ids"][t - 1]):
                    cells.append(f"<b style='color:#1f5fbf'>┃{s['turn_ids'][t]}</b>")
                style = f"background:{_color(v, scale)}" if s["response_mask"][t] else "color:#999"
                cls = "tok seg" if seg and seg[t] >= 0 else "tok"
                cells.append(f"<span class='{cls}' style='{style}' title='{v:+.4f}'>{html.escape(tokstr)}</span>")
            parts.append(f"<tr><td><b>{html.escape(a)}</b></td><td>{''.join(cells)}</td></tr>")
        parts.append("</table>")
    parts.append("</body></html>")
    return "".join(parts)


def _png(rec: dict[str, Any], path: Path, max_samples: int = 4) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    samples = rec["samples"][:max_samples]
    names = rec["assigners"]
    fig, axes = plt.subplots(len(samples), 1, figsize=(14, (len(names) + 2) * 0.45 * len(samples) + 1), squeeze=False)
    for ax, s in zip(axes[:, 0], samples):
        mat = np.array([s["credit"][a] for a in names])
        mat = mat / np.maximum(np.abs(mat).max(axis=1, keepdims=True), 1e-9)  # each row on its own scale
        ax.imshow(mat, aspect="auto", cmap="RdYlGn", vmin=-1, vmax=1, interpolation="nearest")
        ax.set_yticks(range(len(names)), names, fontsize=7)
        T = mat.shape[1]
        ax.set_xticks(range(T), [t.replace("\n", "⏎") for t in s["tokens"]], fontsize=5, rotation=90)
        for a, seg in s["segments"].items():
            row = names.index(a)
            for t, sid in enumerate(seg):
                if sid >= 0:
                    ax.add_patch(plt.Rectangle((t - 0.5, row - 0.5), 1, 1, fill=False, edgecolor="#1f5fbf", lw=0.8))
        for t in range(1, T):  # turn boundaries
            if s["turn_ids"][t] != s["turn_ids"][t - 1]:
                ax.axvline(t - 0.5, color="black", lw=1.0)
        tw = ax.twinx()
        for k, color in (("kl", "#1f5fbf"), ("entropy", "#7f3fbf")):
            if k in s["signals"]:
                tw.plot(range(T), s["signals"][k], color=color, lw=0.8, label=k)
        if s["signals"]:
            tw.legend(loc="upper right", fontsize=6)
            tw.tick_params(labelsize=6)
        ax.set_title(f"reward {s['reward']:.2f}, A = {s['seq_advantage']:+.3f} (each row scaled to its own max |A|)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
