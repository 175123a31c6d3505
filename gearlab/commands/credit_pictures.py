"""The two pictures of ``gearlab inspect``'s record (``credit.json``): tokens coloured by each method's credit.

credit.html  — a self-contained page, one row of coloured tokens per method and sample; the samples with no GRPO
               signal (A = 0) folded away at the end.
credit.png   — one heat-map panel per sample (the most informative first), KL / entropy traces on a twin axis, GEAR
               segments outlined, one colour bar.

Both show the samples in :func:`display_order` and scale colours by :func:`credit_scales`.
"""
from __future__ import annotations

import html
import textwrap
import warnings
from pathlib import Path
from typing import Any


def informative(s: dict[str, Any]) -> bool:
    """A non-zero sequence advantage: the sample carries a GRPO signal (its group's rewards differ)."""
    return abs(s["seq_advantage"]) > 1e-9


def display_order(samples: list[dict[str, Any]]) -> list[int]:
    """Indices of ``samples`` (records with "group", "reward", "seq_advantage") in the order to show them.

    Why: a batch often starts with groups whose responses all got the same reward; their GRPO
    advantage is 0, so most methods assign no credit and the first panels come out blank. Order:
      1. a contrast pair from ONE group: its lowest- then its highest-reward response, taken from the
         group with the largest reward spread (among its informative samples) — a failure and a
         success on the same prompt;
      2. the other informative samples (non-zero seq_advantage), in batch order;
      3. the zero-advantage samples, in batch order.
    Ties are broken by batch position (first group / first sample wins), so the order is
    deterministic; a batch with no informative sample keeps its batch order.
    """
    signal = [i for i, s in enumerate(samples) if informative(s)]
    groups: dict[Any, list[int]] = {}
    for i in signal:
        groups.setdefault(samples[i]["group"], []).append(i)
    pair: list[int] = []
    best = 0.0
    for members in groups.values():  # dict order = order of first appearance; strict ">" keeps the first on ties
        lo = min(members, key=lambda i: (samples[i]["reward"], i))
        hi = max(members, key=lambda i: (samples[i]["reward"], -i))
        spread = samples[hi]["reward"] - samples[lo]["reward"]
        if spread > best:
            best, pair = spread, [lo, hi]
    rest = [i for i in signal if i not in pair]
    zero = [i for i in range(len(samples)) if not informative(samples[i])]
    return pair + rest + zero


def credit_scales(samples: list[dict[str, Any]], names: list[str], shared: bool) -> list[dict[str, float]]:
    """Per sample, per method: the |A| that maps to full colour.

    Only policy tokens (response_mask = 1) count — the others are drawn grey. shared=False: each row's
    own max |A| (compare shapes); shared=True: one global max |A| over everything passed in (compare
    magnitudes across methods and samples). 1e-9 floors an all-zero row (it stays blank).
    """
    def peak(s, a):
        return max([abs(v) for v, m in zip(s["credit"][a], s["response_mask"]) if m] + [1e-9])

    own = [{a: peak(s, a) for a in names} for s in samples]
    if not shared:
        return own
    g = max([v for row in own for v in row.values()] + [1e-9])
    return [{a: g for a in names} for _ in samples]


def _color(v: float, scale: float) -> str:
    x = max(-1.0, min(1.0, v / scale)) if scale > 0 else 0.0
    return f"rgba(0,140,60,{x:.2f})" if x >= 0 else f"rgba(200,30,30,{-x:.2f})"


ORDER_NOTE = ("Order: first a failed and a successful response to the same prompt (the group with the largest "
              "reward spread), then the other samples with a non-zero GRPO advantage, last the samples with A = 0 "
              "(no GRPO signal). Sample numbers are indices into credit.json.")


def _scale_note(shared: bool, scale: float | None = None) -> str:
    if shared:
        return f"one shared scale: every row divided by the global max |A| = {scale:.3g} over everything shown"
    return "each row (method × sample) divided by its own max |A|"


def credit_html(rec: dict[str, Any], shared_scale: bool = False) -> str:
    """credit.html: informative samples first (``display_order``); samples with A = 0 folded in a <details>."""
    samples, names = rec["samples"], rec["assigners"]
    order = display_order(samples)
    scales = credit_scales(samples, names, shared_scale)
    parts = ["<html><head><meta charset='utf-8'><title>gearlab credit</title><style>"
             "body{font-family:sans-serif;margin:20px} td{padding:2px 6px;vertical-align:top} "
             ".tok{font-family:monospace;"
             "white-space:pre;padding:1px 0;border-bottom:3px solid transparent} .seg{border-bottom-color:#1f5fbf}"
             " summary{font-size:1.1em;cursor:pointer;margin:16px 0}</style></head><body>",
             f"<h2>Credit per token — model {html.escape(rec['model'])}, task {html.escape(rec['task'])}</h2>",
             f"<p>Green = positive advantage, red = negative, intensity ∝ |A| / scale "
             f"({_scale_note(shared_scale, scales[0][names[0]] if shared_scale and samples and names else None)}; "
             "hover a token for its value); "
             "blue underline = a GEAR segment; grey = not generated by the policy (masked: environment / tool text); "
             "a bar ┃k marks where turn k starts.</p>",
             f"<p class='order'>{html.escape(ORDER_NOTE)} The A = 0 samples are folded at the end (click to open).</p>"]
    zero = [i for i in order if not informative(samples[i])]
    for i in order:
        if zero and i == zero[0]:
            parts.append(f"<details class='no-signal'><summary>{html.escape(_fold_summary(samples, zero))}</summary>")
        parts.append(_html_sample(i, samples[i], scales[i]))
    if zero:
        parts.append("</details>")
    parts.append("</body></html>")
    return "".join(parts)


def _fold_summary(samples: list[dict[str, Any]], zero: list[int]) -> str:
    """The summary line of the folded block; says why those samples carry no signal."""
    rewards: dict[Any, set[float]] = {}
    for s in samples:
        rewards.setdefault(s["group"], set()).add(s["reward"])
    flat = sum(len(rewards[samples[i]["group"]]) == 1 for i in zero)
    if flat == len(zero):
        return f"{flat} samples from groups where every response got the same reward: no GRPO signal"
    return (f"{len(zero)} samples with A = 0, no GRPO signal: {flat} from groups where every response got the "
            f"same reward, {len(zero) - flat} whose reward equals its group's mean")


def _html_sample(i: int, s: dict[str, Any], scales: dict[str, float]) -> str:
    """One sample: a header line, its prompt and a table of one coloured token row per method."""
    turns = ""
    if "turn_rewards" in s:
        turns = (f" · {len(s['turn_rewards'])} turn(s), turn rewards "
                 f"[{', '.join(f'{r:.2f}' for r in s['turn_rewards'])}] · ended: {s.get('end_reason')}")
    parts = [f"<h3>sample {i} · group {s['group']} · reward {s['reward']:.2f} · A = {s['seq_advantage']:+.3f}"
             f"{html.escape(turns)}</h3><p><i>{html.escape(s['prompt'])}</i></p><table>"]
    multi = "turn_rewards" in s
    for a, vals in s["credit"].items():
        seg = s["segments"].get(a)
        cells = []
        for t, (tokstr, v) in enumerate(zip(s["tokens"], vals)):
            if multi and (t == 0 or s["turn_ids"][t] != s["turn_ids"][t - 1]):
                cells.append(f"<b style='color:#1f5fbf'>┃{s['turn_ids'][t]}</b>")
            style = f"background:{_color(v, scales[a])}" if s["response_mask"][t] else "color:#999"
            cls = "tok seg" if seg and seg[t] >= 0 else "tok"
            cells.append(f"<span class='{cls}' style='{style}' title='{v:+.4f}'>{html.escape(tokstr)}</span>")
        parts.append(f"<tr><td><b>{html.escape(a)}</b></td><td>{''.join(cells)}</td></tr>")
    parts.append("</table>")
    return "".join(parts)


def _label(tok: str) -> str:
    """A token as a tick label: newline as ⏎, tab as ⇥, other control characters as \\xNN, '$' escaped
    (matplotlib would parse "$…$" as math)."""
    tok = tok.replace("\n", "⏎").replace("\t", "⇥").replace("$", r"\$")
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in tok)


def _head(s: dict[str, Any], n: int) -> dict[str, Any]:
    """The sample cut to its first n tokens (every per-token list)."""
    per_token = {k: {a: v[:n] for a, v in s[k].items()} for k in ("credit", "signals", "segments")}
    return {**s, **{k: s[k][:n] for k in ("tokens", "response_mask", "turn_ids")}, **per_token}


def credit_png(rec: dict[str, Any], path: Path, max_samples: int = 4, shared_scale: bool = False,
         max_tokens: int = 120) -> dict[str, Any]:
    """credit.png: one heat-map panel per sample (the first ``max_samples`` of ``display_order``), one row
    per method, KL / entropy traces on a twin axis, and ONE colour bar for the figure. Responses longer
    than ``max_tokens`` are cut (noted in the panel title); the width grows with the tokens shown.

    Returns what was drawn, for tests: {"samples": indices shown, "axes": axes in the figure,
    "twins": trace axes among them, "colorbars": 1, "scale": the shared |A| scale or None}.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = rec["assigners"]
    shown = display_order(rec["samples"])[:max_samples]
    samples = [rec["samples"][i] for i in shown]
    cut = [_head(s, max_tokens) for s in samples]
    scales = credit_scales(cut, names, shared_scale)  # over what is drawn, i.e. after the cut
    T_max = max([len(s["tokens"]) for s in cut] + [1])
    width = min(40.0, max(10.0, 3.0 + 0.22 * T_max))  # ~16 pt per token: 45° labels at font 7 do not collide
    panel_h = 0.3 * len(names) + 1.6  # rows + rotated token labels + title
    fig, axes = plt.subplots(max(1, len(cut)), 1, figsize=(width, panel_h * max(1, len(cut)) + 0.8),
                             squeeze=False, layout="constrained")
    cmap = matplotlib.colormaps["RdYlGn"].with_extremes(bad="#dddddd")  # grey = not a policy token
    im, twins = None, 0
    for ax, i, s, full, sc in zip(axes[:, 0], shown, cut, samples, scales):
        mat = np.array([[v / sc[a] for v in s["credit"][a]] for a in names], dtype=float).reshape(len(names), -1)
        mat[:, ~np.array(s["response_mask"], dtype=bool)] = np.nan
        im = ax.imshow(mat, aspect="auto", cmap=cmap, vmin=-1, vmax=1, interpolation="nearest")
        ax.set_yticks(range(len(names)), names, fontsize=8)
        T = mat.shape[1]
        ax.set_xticks(range(T), [_label(t) for t in s["tokens"]], fontsize=7, rotation=45,
                      ha="right", rotation_mode="anchor")
        for a, seg in s["segments"].items():
            row = names.index(a)
            for t, sid in enumerate(seg):
                if sid >= 0:
                    ax.add_patch(plt.Rectangle((t - 0.5, row - 0.5), 1, 1, fill=False, edgecolor="#1f5fbf", lw=0.8))
        for t in range(1, T):  # turn boundaries
            if s["turn_ids"][t] != s["turn_ids"][t - 1]:
                ax.axvline(t - 0.5, color="black", lw=1.0)
        traces = [(k, c) for k, c in (("kl", "#1f5fbf"), ("entropy", "#7f3fbf")) if k in s["signals"]]
        if traces:
            tw, twins = ax.twinx(), twins + 1
            for k, color in traces:
                tw.plot(range(T), s["signals"][k], color=color, lw=0.8, alpha=0.7, label=k)
            tw.legend(loc="upper right", fontsize=7)
            tw.tick_params(labelsize=7)
        note = "" if len(full["tokens"]) <= max_tokens else f" · first {max_tokens} of {len(full['tokens'])} tokens"
        why = "" if informative(s) else " · A = 0: no GRPO signal"
        ax.set_title(f"sample {i} · group {s['group']} · reward {s['reward']:.2f} · A = {s['seq_advantage']:+.3f}"
                     f"{why}{note}", fontsize=9, loc="left")
    scale = scales[0][names[0]] if shared_scale and scales and names else None
    label = (f"token advantage A / {scale:.3g} (global max |A|, one scale for all rows)" if scale is not None
             else "token advantage A / max |A| of its row (each row on its own scale)")
    if im is not None:
        fig.colorbar(im, ax=axes[:, 0].tolist(), label=label, shrink=min(1.0, 3.0 / max(1, len(cut))), pad=0.01)
    caption = (f"Credit per token — {rec['model']}, {rec['task']}. Green = positive, red = negative, grey = not "
               f"generated by the policy; {_scale_note(shared_scale, scale)}. {ORDER_NOTE}")
    fig.suptitle(textwrap.fill(caption, width=int(width * 13)), fontsize=9)  # ~13 characters per inch at 9 pt
    info = {"samples": shown, "axes": len(fig.axes), "twins": twins, "colorbars": int(im is not None), "scale": scale}
    with warnings.catch_warnings():  # a token the font lacks (e.g. CJK) is drawn as a box: fine, no warning per glyph
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return info
