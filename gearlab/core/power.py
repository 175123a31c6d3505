"""Power of the paired comparison: how large a difference the seeds could have detected, and how many seeds a
given difference needs.

Conventions (every function here):

- The test is the **two-sided one-sample t-test on n paired differences** d_1 … d_n (per seed, method minus
  baseline), H0: E[d] = 0, at level ``alpha`` (default 0.05): reject when |T| > t_crit with
  T = mean(d) / (s / √n), s the unbiased standard deviation, t_crit = t_{1−α/2, n−1}.
- The differences are modelled as independent normal with true mean ``effect`` (δ) and standard deviation
  ``sd`` (σ). Then T follows the **noncentral t** distribution with n − 1 degrees of freedom and noncentrality
  λ = δ·√n / σ, and the power is computed EXACTLY from it (no normal approximation):
  power = P(T > t_crit) + P(T < −t_crit).
- Power depends on δ only through |δ|; effects and detectable differences are in the metric's own units
  (an accuracy of 0.03 is 3 points).
- A quantity that cannot be computed is ``float("nan")`` (fewer than two differences, or an unknown SD);
  ``sd == 0`` means every seed moved by exactly the same amount, so any nonzero effect is detected.

Depends on scipy only.
"""
from __future__ import annotations

import math

__all__ = ["MIN_INTERVAL_N", "interval_note", "mde_paired", "paired_sd", "power_paired", "reported_interval",
           "seeds_needed", "t_interval"]

#: the fewest values whose 95% t-interval gearlab reports as evidence: with two, the interval rests on one degree of
#: freedom (t = 12.7) and an SD estimated from a single difference, and two equal values give a zero-width interval
MIN_INTERVAL_N = 3


def paired_sd(diffs: list[float]) -> float:
    """The unbiased (n − 1) standard deviation of the per-seed paired differences; NaN when n < 2."""
    n = len(diffs)
    if n < 2:
        return float("nan")
    m = sum(diffs) / n
    return math.sqrt(sum((d - m) ** 2 for d in diffs) / (n - 1))


def _check(power: float, alpha: float) -> None:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    if not alpha < power < 1.0:
        raise ValueError(f"power must lie in (alpha, 1) = ({alpha}, 1), got {power}")


def _power_nc(nc: float, df: int, t_crit: float) -> float:
    """P(|T| > t_crit) for T ~ noncentral t(df, nc). The lower tail P(T < −t_crit) is taken as the upper tail of
    nct(df, −nc) (T(nc) has the law of −T(−nc)): scipy's cdf far in the tail can return NaN where sf does not."""
    from scipy.stats import nct

    return float(nct.sf(t_crit, df, nc) + nct.sf(t_crit, df, -nc))


def power_paired(effect: float, sd: float, n: int, alpha: float = 0.05) -> float:
    """Exact power of the two-sided paired t-test (level ``alpha``) on ``n`` differences with true mean
    ``effect`` and standard deviation ``sd``: P(|T| > t_{1−α/2, n−1}), T ~ nct(df=n−1, nc=effect·√n/sd).

    NaN when n < 2 or sd / effect is NaN. With sd == 0 the power is 1 for a nonzero effect and ``alpha`` for a
    zero one (the level, by convention). At effect == 0 the power equals ``alpha``."""
    from scipy.stats import t

    if n < 2 or math.isnan(sd) or math.isnan(effect):
        return float("nan")
    if sd < 0:
        raise ValueError(f"sd must be >= 0, got {sd}")
    if sd == 0:
        return 1.0 if effect != 0 else alpha
    df = n - 1
    return _power_nc(abs(effect) * math.sqrt(n) / sd, df, float(t.ppf(1 - alpha / 2, df)))


def mde_paired(sd: float, n: int, power: float = 0.8, alpha: float = 0.05) -> float:
    """The minimum detectable effect: the smallest true mean paired difference (> 0, metric units) that the
    two-sided one-sample t-test at level ``alpha`` on ``n`` paired differences of standard deviation ``sd``
    rejects with probability ``power``.

    Exact: solves power = P(|T| > t_crit) under T ~ nct(df=n−1, nc=λ) for the noncentrality λ (root finding,
    relative precision ~1e-12) and returns λ·sd/√n. For large n it approaches (z_{1−α/2} + z_{power})·sd/√n
    (2.8016·sd/√n at the defaults); for small n it is larger than that. NaN when n < 2 or sd is NaN; 0 when
    sd == 0."""
    from scipy.optimize import brentq
    from scipy.stats import t

    _check(power, alpha)
    if n < 2 or math.isnan(sd):
        return float("nan")
    if sd < 0:
        raise ValueError(f"sd must be >= 0, got {sd}")
    if sd == 0:
        return 0.0
    df = n - 1
    t_crit = float(t.ppf(1 - alpha / 2, df))
    hi = t_crit + 4.0
    while _power_nc(hi, df, t_crit) < power:  # power rises with λ from alpha (λ = 0) to 1
        hi *= 2.0
        if hi > 1e12:
            raise RuntimeError("mde_paired: no noncentrality reaches the power")
    nc = brentq(lambda x: _power_nc(x, df, t_crit) - power, 0.0, hi, xtol=1e-13, rtol=1e-14, maxiter=500)
    return nc * sd / math.sqrt(n)


def seeds_needed(effect: float, sd: float, power: float = 0.8, alpha: float = 0.05, max_n: int = 10000) -> int | None:
    """The smallest number of seeds (paired differences) n >= 2 whose exact power (:func:`power_paired`)
    reaches ``power`` for a true mean difference ``effect`` (its sign does not matter) when the differences
    have standard deviation ``sd``. None when ``sd`` or ``effect`` is NaN, when ``effect`` is 0, or when more than
    ``max_n`` seeds would be needed. With sd == 0 and a nonzero effect, 2.

    Consistent with :func:`mde_paired`: seeds_needed(e, sd) is the smallest n with mde_paired(sd, n) <= e."""
    _check(power, alpha)
    if math.isnan(sd) or math.isnan(effect) or effect == 0:
        return None
    if sd < 0:
        raise ValueError(f"sd must be >= 0, got {sd}")
    if sd == 0:
        return 2

    def ok(n: int) -> bool:
        return power_paired(effect, sd, n, alpha) >= power

    if ok(2):
        return 2
    if max_n < 2 or not ok(max_n):
        return None
    lo, hi = 2, max_n  # power rises with n: ok(lo) is False, ok(hi) True
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def t_interval(xs: list[float]) -> tuple[float, float | None]:
    """(mean, half-width of the 95% Student-t interval) — half-width None when n < 2."""
    n = len(xs)
    if n == 0:
        return float("nan"), None
    mean = sum(xs) / n
    if n < 2:
        return mean, None
    from scipy.stats import t

    s = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    return mean, float(t.ppf(0.975, n - 1)) * s / math.sqrt(n)


def interval_note(xs: list[float]) -> str | None:
    """Why the 95% t-interval of ``xs`` is not reported, or None when it is.

    ``"n too small"`` with fewer than :data:`MIN_INTERVAL_N` values; ``"no spread, interval undefined"`` when every
    value is the same (up to float rounding: e.g. two equal changes computed from different starts), which the
    zero-width interval would otherwise present as certainty. No spread is said first: it is the more specific
    reason when both hold."""
    n = len(xs)
    if n >= 2:
        mean = sum(xs) / n
        scale = max(1.0, max(abs(x) for x in xs))
        if math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) <= 1e-12 * scale:
            return "no spread, interval undefined"
    if n < MIN_INTERVAL_N:
        return "n too small"
    return None


def reported_interval(xs: list[float]) -> tuple[float, float | None, str | None]:
    """(mean, half-width of the 95% t-interval or None, reason it is withheld or None): :func:`t_interval` with the
    degenerate cases of :func:`interval_note` turned into a reason instead of a number."""
    mean, hw = t_interval(xs)
    note = interval_note(xs) if xs else None
    return mean, (None if note else hw), note
