"""The contract kit: property checks every credit assigner must pass, on random batches.

Run it on your method before trusting it: ``gearlab check-assigner NAME`` or, in a test,
``assert_contract("NAME")``. Checks: output type/shape/dtype/device, no credit on masked tokens,
zero-advantage sequences stay zero, declared signals are actually used, deterministic, no
gradient flowing back through signals, and the promises the class declares (sign / mass
preservation, segments within turns, refusing single-turn tasks when it needs turns).
Signals are synthetic (random but well-formed), so the kit needs no model and runs in milliseconds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from gearlab import credit
from gearlab.core.batch import RolloutBatch
from gearlab.credit import CreditAssigner, CreditOutput
from gearlab.signals.registry import get_signal, signal_name


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


class _SingleTurnTask:
    name = "single_turn_probe"
    multi_turn = False


class _MultiTurnTask:
    name = "multi_turn_probe"
    multi_turn = True


def random_batch(
    seed: int, *, groups: int = 3, group_size: int = 4, T: int = 24, multi_turn: bool = False
) -> RolloutBatch:
    """A well-formed random RolloutBatch: ragged lengths, one all-equal-reward group, teacher prompts;
    with ``multi_turn`` 2–3 turns per sequence separated by masked environment tokens."""
    g = torch.Generator().manual_seed(seed)
    B = groups * group_size
    lengths = torch.randint(T // 3, T + 1, (B,), generator=g)
    attn = torch.arange(T)[None, :] < lengths[:, None]
    resp_mask = attn.clone()
    turn_ids = torch.zeros(B, T, dtype=torch.long)
    K = 3
    turn_rewards = torch.full((B, K), float("nan"))
    anchor_obs: list[list[Any]] = []
    if multi_turn:
        for i in range(B):
            n = int(lengths[i])
            k = int(torch.randint(2, K + 1, (1,), generator=g))
            cuts = sorted(torch.randperm(n - 4, generator=g)[: k - 1].add(2).tolist())
            bounds = [0, *cuts, n]
            for t in range(k):
                turn_ids[i, bounds[t]:bounds[t + 1]] = t
                env = min(2, bounds[t + 1] - bounds[t] - 1) if t < k - 1 else 0
                if env > 0:  # the tail of each non-final turn is environment text
                    resp_mask[i, bounds[t + 1] - env:bounds[t + 1]] = False
            turn_ids[i, n:] = k - 1
            turn_rewards[i, :k] = torch.randint(0, 2, (k,), generator=g).float()
            anchor_obs.append([f"obs{t}-{int(torch.randint(0, 2, (1,), generator=g))}" for t in range(k)])
    rewards = torch.randint(0, 2, (B,), generator=g).float()
    rewards[:group_size] = 1.0  # an all-equal group
    V = 50
    P = 5
    return RolloutBatch(
        prompt_ids=torch.randint(3, V, (B, P), generator=g), prompt_mask=torch.ones(B, P, dtype=torch.long),
        response_ids=torch.randint(3, V, (B, T), generator=g), response_mask=resp_mask, attention_mask=attn,
        group_ids=torch.arange(groups).repeat_interleave(group_size), rewards=rewards,
        turn_ids=turn_ids if multi_turn else None, turn_rewards=turn_rewards if multi_turn else None,
        teacher_prompt_ids=torch.randint(3, V, (B, P + 3), generator=g), teacher_prompt_mask=torch.ones(B, P + 3,
        dtype=torch.long),
        meta={"anchor_obs": anchor_obs} if multi_turn else {},
    )


def fake_signals(batch: RolloutBatch, needs: frozenset, seed: int) -> dict:
    """Random, well-formed values for every declared signal (0 on masked tokens), made as each signal's
    registration says (``fake=``, see ``gearlab.signals.registry.FAKES``) — plug-in signals included."""
    g = torch.Generator().manual_seed(10_000 + seed)
    B, T = batch.response_ids.shape
    m = batch.response_mask.float()
    rnd = lambda: torch.randn(B, T, generator=g)  # noqa: E731

    def reasoning_mask() -> Tensor:
        k = torch.randint(1, 6, (B, 1), generator=g)  # the last k generated tokens are the "answer"
        return (~(m.cumsum(-1) > (m.sum(-1, keepdim=True) - k))).float()

    makers: dict[str, Callable[[], Tensor]] = {
        "entropy": lambda: torch.rand(B, T, generator=g) * 3,
        "logprob": lambda: -rnd().exp(),
        "kl": lambda: (rnd() - 1).exp(),
        "nonneg": lambda: rnd().abs(),
        "signed": rnd,
        "reasoning_mask": reasoning_mask,
        "mask": lambda: (torch.rand(B, T, generator=g) < 0.5).float(),
        "prob": lambda: 1.0 - torch.rand(B, T, generator=g),
    }
    return {s: makers[get_signal(s).fake]() * m for s in needs}


def _seq_adv(batch: RolloutBatch) -> Tensor:
    from gearlab.core.grpo import group_advantages

    return group_advantages(batch.rewards, batch.group_ids)


def _same_mask(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a.bool(), b.bool())


def check_assigner(make: Callable[[], CreditAssigner] | str, options: dict[str, Any] | None = None,
                   seeds: tuple[int, ...] = (0, 1, 2)) -> list[Check]:
    """Run every contract check; ``make`` builds a fresh assigner (or give a registered name + options). A check
    that fails on one seed is reported once, with that seed; a crash inside a check is a failure with its message."""
    if isinstance(make, str):
        name, opts = make, dict(options or {})
        make = lambda: credit.build(name, opts)  # noqa: E731
    kit = _Kit(make)
    probe = make()
    if kit.multi:
        try:
            probe.setup(seed=0, total_steps=10, task=_SingleTurnTask())
            kit.checks.append(Check("refuses single-turn tasks", False, "setup() accepted a single-turn task"))
        except ValueError as e:
            kit.checks.append(Check("refuses single-turn tasks", True, str(e)[:80]))
    plan: list[tuple[str, Callable[[int], str | None], bool]] = [
        ("output type, shape, dtype, device", kit.output_ok, True),
        ("no credit on masked tokens", kit.masked_zero, True),
        ("zero-advantage sequences stay zero", kit.zero_groups, probe.keeps_zero_groups),
        ("the signals of zero-advantage sequences are not read", kit.zero_rows_ignored, probe.ignores_zero_rows),
        ("deterministic", kit.deterministic, True),
        ("no gradient through signals", kit.no_grad_leak, True),
        ("declared signals are used", kit.signals_used, bool(probe.needs)),
        ("sign preserved", kit.sign_kept, probe.preserves_sign),
        ("mass preserved (Σ_t A_t = N·A)", kit.mass_kept, probe.preserves_mass),
        ("segments stay within a turn and on generated tokens", kit.segments_in_turns, True),
    ]
    for name_, fn, applies in plan:
        if applies:
            kit.each(name_, fn, seeds)
    return kit.checks


class _Kit:
    """The contract checks of one assigner; each takes a seed and returns None or what is wrong."""

    def __init__(self, make: Callable[[], CreditAssigner]) -> None:
        self.make = make
        self.multi = bool(make().requires_turns)
        self.task = _MultiTurnTask() if self.multi else _SingleTurnTask()
        self.checks: list[Check] = []

    def fresh(self, seed: int) -> CreditAssigner:
        a = self.make()
        a.setup(seed=seed, total_steps=10, task=self.task)
        return a

    def run(self, seed: int) -> tuple[CreditAssigner, RolloutBatch, Tensor, CreditOutput]:
        """A fresh assigner on the seed's random batch and synthetic signals: (assigner, batch, A_seq, output)."""
        a = self.fresh(seed)
        b = random_batch(seed, multi_turn=self.multi)
        adv = _seq_adv(b)
        return a, b, adv, a.assign(b, adv, fake_signals(b, frozenset(a.needs), seed))

    def each(self, name: str, fn: Callable[[int], str | None], seeds: tuple[int, ...]) -> None:
        for seed in seeds:
            try:
                problem = fn(seed)
            except Exception as e:  # a crash is a failed check, reported with its message
                problem = f"{type(e).__name__}: {e}"
            if problem:
                self.checks.append(Check(name, False, f"seed {seed}: {problem}"))
                return
        self.checks.append(Check(name, True))

    def output_ok(self, seed: int) -> str | None:
        _, b, _, out = self.run(seed)
        if not isinstance(out, CreditOutput):
            return f"assign returned {type(out).__name__}, not CreditOutput"
        A = out.token_advantages
        if tuple(A.shape) != tuple(b.response_ids.shape):
            return f"token_advantages shape {tuple(A.shape)} != {tuple(b.response_ids.shape)}"
        if not A.is_floating_point():
            return f"token_advantages dtype {A.dtype} is not floating point"
        if A.device != b.response_ids.device:
            return f"token_advantages on {A.device}, batch on {b.response_ids.device}"
        if not torch.isfinite(A).all():
            return "non-finite advantages"
        if out.loss_mask is not None and tuple(out.loss_mask.shape) != tuple(A.shape):
            return f"loss_mask shape {tuple(out.loss_mask.shape)} != {tuple(A.shape)}"
        bad = [k for k, v in out.metrics.items() if not isinstance(v, (int, float)) and not (
            isinstance(v, Tensor) and v.numel() == 1
        )]
        return f"metrics not scalar: {bad}" if bad else None

    def masked_zero(self, seed: int) -> str | None:
        _, b, _, out = self.run(seed)
        leak = out.token_advantages[~b.response_mask].abs().max().item() if (~b.response_mask).any() else 0.0
        return f"|A| up to {leak:.3g} on masked (pad / env) tokens" if leak > 0 else None

    def zero_groups(self, seed: int) -> str | None:
        _, b, adv, out = self.run(seed)
        rows = adv == 0
        leak = out.token_advantages[rows].abs().max().item() if rows.any() else 0.0
        return f"|A| up to {leak:.3g} on sequences with zero advantage" if leak > 0 else None

    def zero_rows_ignored(self, seed: int) -> str | None:
        """The signals of the rows with A_i = 0 zeroed (as the provider leaves them when it skips those rows), then
        replaced by other random values: the credit and the metrics must not change."""
        a, b, adv, out = self.run(seed)
        zero = adv == 0
        if not zero.any():
            return "the batch has no zero-advantage row"
        base = fake_signals(b, frozenset(a.needs), seed)
        for k, alt in enumerate(({s: v * ~zero[:, None] for s, v in base.items()},
                                 fake_signals(b, frozenset(a.needs), seed + 100))):
            mixed = {s: torch.where(zero[:, None], alt[s], v) for s, v in base.items()}
            out2 = self.fresh(seed).assign(b, adv, mixed)
            if not torch.equal(out2.token_advantages, out.token_advantages):
                return f"the credit changed with the zero rows' signals {('zeroed', 'replaced')[k]}"
            if out2.metrics != out.metrics:
                diff = sorted(m for m in out.metrics if out2.metrics.get(m) != out.metrics[m])
                return f"metrics {diff} changed with the zero rows' signals {('zeroed', 'replaced')[k]}"
        return None

    def deterministic(self, seed: int) -> str | None:
        o1, o2 = self.run(seed)[3], self.run(seed)[3]
        same = torch.equal(o1.token_advantages, o2.token_advantages) and _same_mask(o1.loss_mask, o2.loss_mask)
        return None if same else "two runs on the same input differ"

    def no_grad_leak(self, seed: int) -> str | None:
        a = self.fresh(seed)
        b = random_batch(seed, multi_turn=self.multi)
        sig = {k: v.clone().requires_grad_(True) for k, v in fake_signals(b, frozenset(a.needs), seed).items()}
        out = a.assign(b, _seq_adv(b), sig)
        return (
            "token_advantages carry a gradient path to the signals (detach them)"
        ) if out.token_advantages.requires_grad else None

    def signals_used(self, seed: int) -> str | None:
        """Each declared signal, replaced by other random values (three tries), must change the output."""
        a, b, adv, out = self.run(seed)
        unused = []
        for s in sorted(a.needs, key=signal_name):
            base = fake_signals(b, frozenset(a.needs), seed)
            changed = False
            for k in range(3):
                alt = dict(base)
                alt[s] = fake_signals(b, frozenset(a.needs), seed + 100 + k)[s]
                out2 = self.fresh(seed).assign(b, adv, alt)
                if not torch.equal(
                    out2.token_advantages, out.token_advantages
                ) or not _same_mask(out2.loss_mask, out.loss_mask):
                    changed = True
                    break
            if not changed:
                unused.append(signal_name(s))
        return f"declared but never changes the output: {unused}" if unused else None

    def sign_kept(self, seed: int) -> str | None:
        _, b, adv, out = self.run(seed)
        A = out.token_advantages
        nz = (A != 0) & b.response_mask
        flips = (torch.sign(A) != torch.sign(adv)[:, None]) & nz
        return f"{int(flips.sum())} tokens flip sign" if flips.any() else None

    def mass_kept(self, seed: int) -> str | None:
        _, b, adv, out = self.run(seed)
        got = out.token_advantages.double().sum(-1)
        want = adv.double() * b.response_mask.sum(-1)
        err = (got - want).abs().max().item()
        return f"Σ_t A_t differs from N·A by {err:.3g}" if err > 1e-5 * max(1.0, want.abs().max().item()) else None

    def segments_in_turns(self, seed: int) -> str | None:
        a, b, _, _ = self.run(seed)
        seg = getattr(a, "last_segments", None)
        if seg is None:
            return None
        for i in range(b.batch_size):
            for sid in seg[i].unique().tolist():
                if sid < 0:
                    continue
                where = seg[i] == sid
                if not b.response_mask[i][where].all():
                    return f"segment {sid} of row {i} covers a masked token"
                if b.turn_ids is not None and b.turn_ids[i][where].unique().numel() > 1:
                    return f"segment {sid} of row {i} crosses a turn boundary"
                idx = where.nonzero().flatten()
                if (idx[1:] - idx[:-1] != 1).any():
                    return f"segment {sid} of row {i} is not contiguous"
        return None


def assert_contract(name: str, options: dict[str, Any] | None = None) -> None:
    """pytest helper: fail with every broken check listed."""
    bad = [c for c in check_assigner(name, options) if not c.ok]
    assert not bad, f"assigner {name!r} breaks its contract:\n" + "\n".join(f"  {c.name}: {c.detail}" for c in bad)
