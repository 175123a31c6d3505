"""`gearlab inspect` runs every applicable assigner on one batch and writes JSON / HTML / PNG."""
import json
import re
from html import unescape
from html.parser import HTMLParser

import pytest

from gearlab import credit
from gearlab.config import load_config
from gearlab.commands.inspect import _html, _png, credit_scales, display_order, inspect


def test_inspect_writes_the_three_files(tmp_path, tiny_model_dir):
    cfg = load_config([f"model.name_or_path={tiny_model_dir}", f"trainer.output_dir={tmp_path}",
                       f"inspect.out_dir={tmp_path / 'insp'}", "inspect.prompts=2", "rollout.group_size=2",
                       "rollout.max_new_tokens=10"])
    out = inspect(cfg)
    rec = json.loads((tmp_path / "insp" / "credit.json").read_text())
    # every single-turn method but those that sample extra rollouts (vineppo: only when named)
    single_turn = [n for n in credit.available()
                   if not credit.get(n).requires_turns and not credit.get(n).extra_rollouts]
    assert rec["assigners"] == single_turn and "vineppo" not in single_turn and len(rec["samples"]) == 4
    s = rec["samples"][0]
    assert {"tokens", "response_mask", "turn_ids", "reward", "seq_advantage", "credit", "signals", "segments"} <= set(s)
    assert set(s["credit"]) == set(single_turn)
    assert all(len(v) == len(s["tokens"]) for v in s["credit"].values())
    if "gear" in single_turn:
        assert "kl" in s["signals"] and "gear" in s["segments"]
    html = (tmp_path / "insp" / "credit.html").read_text()
    assert html.startswith("<html>") and "grpo" in html
    assert (tmp_path / "insp" / "credit.png").read_bytes()[:4] == b"\x89PNG"
    assert out["png"].endswith("credit.png")
    assert rec["order"] == display_order(rec["samples"]) and sorted(rec["order"]) == list(range(4))
    assert all(s["informative"] == (s["seq_advantage"] != 0) for s in rec["samples"])


def test_the_inspect_line_after_a_tool_task_run_is_a_command_that_works(tmp_path, tiny_model_dir):
    """The closing line of `gearlab train` on the tool task names task=tool_arith and the sampling keys the run
    changed; pasted back (shell-split), it inspects that task: multi-turn episodes and the turn methods."""
    import shlex
    import shutil

    from gearlab.cli import main
    from gearlab.commands.closing import train_summary
    from gearlab.trainer.train import TrainResult

    cfg = load_config(["task=tool_arith", f"trainer.output_dir={tmp_path}", "rollout.group_size=2",
                       "rollout.max_new_tokens=32", "rollout.max_turns=2", "trainer.max_steps=2", "optim.lr=1e-3"])
    rdir = tmp_path / "tool_arith-grpo-s0"
    shutil.copytree(tiny_model_dir, rdir / "final")  # the trained model's place
    res = TrainResult(rdir, "", "", {}, iterations_done=2, max_steps=2)
    line = train_summary(res, ["train"], cfg).splitlines()[-1]
    assert line == (f"see its credit on one batch: gearlab inspect task=tool_arith model.name_or_path={rdir / 'final'} "
                    f"rollout.group_size=2 rollout.max_new_tokens=32 rollout.max_turns=2")
    words = shlex.split(line.split(": ", 1)[1])
    assert words[:2] == ["gearlab", "inspect"]
    assert main([*words[1:], f"inspect.out_dir={tmp_path / 'insp'}", "inspect.prompts=1",
                 "inspect.assigners=[grpo,mt_grpo]"]) == 0
    rec = json.loads((tmp_path / "insp" / "credit.json").read_text())
    assert rec["task"] == "tool_arith" and rec["assigners"] == ["grpo", "mt_grpo"] and len(rec["samples"]) == 2
    assert all("turn_rewards" in s for s in rec["samples"])  # multi-turn episodes, not the default arith task


def test_inspect_line_quotes_what_the_shell_would_split_and_names_a_task_without_yaml(tmp_path):
    from gearlab.commands.inspect import inspect_command

    cfg = load_config(["task=jsonl", "task.options.train_path=my data/train.jsonl", "task.options.test_path='true'",
                       "model.dtype=float32"])
    line = inspect_command(cfg, "runs/x/final")
    assert line == ("gearlab inspect task=jsonl model.name_or_path=runs/x/final 'task.options.test_path=\"true\"' "
                    "'task.options.train_path=my data/train.jsonl' model.dtype=float32")
    back = load_config(shlex_words(line)[2:])  # a file named "true" stays a string, the space stays in the path
    assert dict(back.task.options) == {"train_path": "my data/train.jsonl", "test_path": "true"}
    # a task registered by a plug-in, with no conf/task/NAME.yaml: task=NAME would not load, task.name=NAME does
    cfg = load_config(["task.name=my_plugin_task", "task.plugins=[my_tasks.py]", "task.options.level=3"])
    line = inspect_command(cfg, "m")
    assert line == ("gearlab inspect task.name=my_plugin_task model.name_or_path=m task.options.level=3 "
                    "'task.plugins=[my_tasks.py]'")
    back = load_config(shlex_words(line)[2:])
    assert (back.task.name, dict(back.task.options), list(back.task.plugins)) == ("my_plugin_task", {"level": 3},
                                                                                  ["my_tasks.py"])


def shlex_words(line: str) -> list[str]:
    import shlex

    return shlex.split(line)


# ---- the pictures' order, folding and colour scale, on hand-made sample records (no model) ----

def _samples(rewards: list[list[float]], groups: list[int] | None = None, T: int = 6) -> list[dict]:
    """Sample records like credit.json's: one inner list of rewards per group, GRPO advantages computed
    by the real ``group_advantages``; method "grpo" gets A on every token, "half" gets A/2 on the first half."""
    import torch

    from gearlab.core.grpo import group_advantages

    groups = groups if groups is not None else list(range(len(rewards)))
    flat = [(g, r) for g, rs in zip(groups, rewards) for r in rs]
    adv = group_advantages(torch.tensor([r for _, r in flat]), torch.tensor([g for g, _ in flat])).tolist()
    return [{"prompt": f"q{g}", "tokens": [f"t{t}" for t in range(T - 1)] + ["\n"], "response_mask": [1] * T,
             "turn_ids": [0] * T, "group": g, "reward": r, "seq_advantage": a,
             "credit": {"grpo": [a] * T, "half": [a / 2 if t < T // 2 else 0.0 for t in range(T)]},
             "signals": {"kl": [0.1] * T} if k % 2 else {}, "segments": {}}
            for k, ((g, r), a) in enumerate(zip(flat, adv))]


def _record(samples: list[dict]) -> dict:
    return {"model": "m", "task": "t", "assigners": ["grpo", "half"], "metrics": {}, "samples": samples}


def test_display_order_puts_a_contrast_pair_first_and_zero_advantage_last():
    # group 0 (all equal, first in the batch) → last; group 2 has the largest spread (0 … 1):
    # its min (index 8) then its first max (index 9, tied with 11) lead
    s = _samples([[1, 1, 1, 1], [0.2, 0.6, 0.2, 0.6], [0, 1, 0.5, 1]])
    assert [x["seq_advantage"] == 0 for x in s[:4]] == [True] * 4
    assert display_order(s) == [8, 9, 4, 5, 6, 7, 10, 11, 0, 1, 2, 3]


def test_display_order_ties_and_all_zero_batches():
    # equal spreads: the group that appears first in the batch wins (not the smaller id);
    # within it, the first of the tied minima / maxima
    s = _samples([[1, 0, 1, 0], [0, 1, 0, 1]], groups=[5, 3])
    assert display_order(s) == [1, 0, 2, 3, 4, 5, 6, 7]
    assert display_order(s) == display_order(s)  # pure
    # no GRPO signal anywhere: batch order
    assert display_order(_samples([[1, 1], [0, 0], [0.5, 0.5]])) == [0, 1, 2, 3, 4, 5]
    # a response whose reward is its group's mean has A = 0 too: shown after the informative ones
    assert display_order(_samples([[0, 0.5, 1]])) == [0, 2, 1]
    assert display_order([]) == []


class _Headers(HTMLParser):
    """The sample headers (<h3>) of credit.html, each with whether it sits inside a <details> block."""

    def __init__(self):
        super().__init__()
        self.depth, self.h3, self.headers, self.summaries = 0, None, [], []
        self.in_summary = False

    def handle_starttag(self, tag, attrs):
        self.depth += tag == "details"
        self.in_summary |= tag == "summary"
        if tag == "h3":
            self.h3 = ""

    def handle_endtag(self, tag):
        self.depth -= tag == "details"
        self.in_summary &= tag != "summary"
        if tag == "h3":
            self.headers.append((self.h3, self.depth > 0))
            self.h3 = None

    def handle_data(self, data):
        if self.h3 is not None:
            self.h3 += data
        if self.in_summary:
            self.summaries.append(data)


def test_html_folds_the_zero_advantage_samples():
    s = _samples([[1, 1, 1, 1], [0.2, 0.6, 0.2, 0.6], [0, 1, 0.5, 1]])
    page = _html(_record(s))
    p = _Headers()
    p.feed(page)
    shown = [int(h.split()[1]) for h, _ in p.headers]
    assert shown == display_order(s)
    assert [folded for _, folded in p.headers] == [False] * 8 + [True] * 4
    assert p.summaries == ["4 samples from groups where every response got the same reward: no GRPO signal"]
    assert page.count("<details") == 1 and "Order: first a failed and a successful response" in page
    # a response whose reward is its group's mean (A = 0) is folded too, and the summary says why
    assert "1 whose reward equals its group's mean" in unescape(_html(_record(_samples([[1, 1], [0, 0.5, 1]]))))
    # nothing to fold: no <details>
    assert "<details" not in _html(_record(_samples([[0, 1]])))


def _alphas(page: str) -> list[float]:
    return [float(a) for a in re.findall(r"rgba\(\d+,\d+,\d+,([\d.]+)\)", page)]


def test_shared_scale_puts_every_row_on_one_scale():
    s = _samples([[0, 1], [0, 1]])  # the same A in both groups: make the second one's credit 10× larger
    for x in s[2:]:
        x["credit"] = {a: [10 * v for v in vals] for a, vals in x["credit"].items()}
    names = ["grpo", "half"]
    own = credit_scales(s, names, shared=False)
    assert own[0]["grpo"] == pytest.approx(2 * own[0]["half"]) and own[2]["grpo"] == pytest.approx(10 * own[0]["grpo"])
    shared = credit_scales(s, names, shared=True)
    assert {v for row in shared for v in row.values()} == {own[2]["grpo"]}
    # per row: every row reaches full colour; shared: only the largest row does, the others are fainter
    assert sorted(set(_alphas(_html(_record(s)))))[-1] == 1.0 and set(_alphas(_html(_record(s)))) == {0.0, 1.0}
    page = _html(_record(s), shared_scale=True)
    assert set(_alphas(page)) == {0.0, 0.05, 0.1, 0.5, 1.0}
    assert "one shared scale" in page and "its own max |A|" not in page


def test_png_has_a_colour_bar_and_shows_informative_samples_first(tmp_path):
    s = _samples([[1, 1, 1, 1], [0, 1, 0, 0]], T=150)  # longer than max_tokens: cut
    rec = _record(s)
    info = _png(rec, tmp_path / "c.png", max_samples=3, max_tokens=40)
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert info["samples"] == display_order(s)[:3] == [4, 5, 6]
    assert info["colorbars"] == 1 and info["axes"] == len(info["samples"]) + info["twins"] + 1
    assert info["scale"] is None
    info = _png(rec, tmp_path / "s.png", shared_scale=True)
    assert info["scale"] == pytest.approx(max(abs(x["seq_advantage"]) for x in s))
    assert info["axes"] == 4 + info["twins"] + 1


def test_shared_scale_is_a_config_key():
    assert load_config([]).inspect.shared_scale is False
    assert load_config(["inspect.shared_scale=true"]).inspect.shared_scale is True


def test_two_labels_of_one_method_get_their_own_signals(tmp_path, tiny_model_dir, monkeypatch):
    """A signal computed with another method label's options is another signal: shear with one span per response
    and with 4-token spans must not share the cached span distances (they once did)."""
    import hashlib

    from gearlab.tasks.arithmetic import ArithmeticTask

    # a random tiny model is never right: reward a hash of the text, so that groups have both outcomes
    monkeypatch.setattr(ArithmeticTask, "reward", lambda self, p, c: float(hashlib.sha256(c.encode()).digest()[0] % 2))
    cfg = load_config([f"model.name_or_path={tiny_model_dir}", f"trainer.output_dir={tmp_path}",
                       f"inspect.out_dir={tmp_path / 'insp'}", "inspect.prompts=2", "rollout.group_size=4",
                       "rollout.max_new_tokens=12", "inspect.assigners=[shear,'shear:span_len=4,stride=2']"])
    inspect(cfg)
    rec = json.loads((tmp_path / "insp" / "credit.json").read_text())
    a, b = "shear", "shear:span_len=4,stride=2"
    assert rec["assigners"] == [a, b]
    assert any(s["credit"][a] != s["credit"][b] for s in rec["samples"] if s["seq_advantage"] != 0)
