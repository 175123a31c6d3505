"""credit.html and credit.png: the order of the samples, the folding of those with no GRPO signal and the colour
scale, on hand-made sample records (no model)."""
import re
from html import unescape
from html.parser import HTMLParser

import pytest

from gearlab.commands.credit_pictures import credit_html, credit_png, credit_scales, display_order


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
    page = credit_html(_record(s))
    p = _Headers()
    p.feed(page)
    shown = [int(h.split()[1]) for h, _ in p.headers]
    assert shown == display_order(s)
    assert [folded for _, folded in p.headers] == [False] * 8 + [True] * 4
    assert p.summaries == ["4 samples from groups where every response got the same reward: no GRPO signal"]
    assert page.count("<details") == 1 and "Order: first a failed and a successful response" in page
    # a response whose reward is its group's mean (A = 0) is folded too, and the summary says why
    assert "1 whose reward equals its group's mean" in unescape(credit_html(_record(_samples([[1, 1], [0, 0.5, 1]]))))
    # nothing to fold: no <details>
    assert "<details" not in credit_html(_record(_samples([[0, 1]])))


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
    assert set(_alphas(credit_html(_record(s)))) == {0.0, 1.0}
    page = credit_html(_record(s), shared_scale=True)
    assert set(_alphas(page)) == {0.0, 0.05, 0.1, 0.5, 1.0}
    assert "one shared scale" in page and "its own max |A|" not in page


def test_png_has_a_colour_bar_and_shows_informative_samples_first(tmp_path):
    s = _samples([[1, 1, 1, 1], [0, 1, 0, 0]], T=150)  # longer than max_tokens: cut
    rec = _record(s)
    info = credit_png(rec, tmp_path / "c.png", max_samples=3, max_tokens=40)
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert info["samples"] == display_order(s)[:3] == [4, 5, 6]
    assert info["colorbars"] == 1 and info["axes"] == len(info["samples"]) + info["twins"] + 1
    assert info["scale"] is None
    info = credit_png(rec, tmp_path / "s.png", shared_scale=True)
    assert info["scale"] == pytest.approx(max(abs(x["seq_advantage"]) for x in s))
    assert info["axes"] == 4 + info["twins"] + 1
