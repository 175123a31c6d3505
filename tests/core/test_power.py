"""The paired power calculation (gearlab.core.power): exact noncentral-t values checked against independent
computations (a direct integral over the sample variance, a seeded simulation) and the normal limit."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate
from scipy.stats import chi2, norm, t

from gearlab.core.power import (
    interval_note,
    mde_paired,
    paired_sd,
    power_paired,
    reported_interval,
    seeds_needed,
    t_interval,
)


def _power_by_integral(effect: float, sd: float, n: int, alpha: float = 0.05) -> float:
    """P(|T| > t_crit) computed without the noncentral t: T = (Z + λ) / sqrt(V / df), Z ~ N(0, 1) and
    V ~ chi2(df) independent, so the power is the chi2-average of the normal tail probabilities."""
    df, lam = n - 1, effect * math.sqrt(n) / sd
    tc = t.ppf(1 - alpha / 2, df)

    def f(v):
        c = tc * math.sqrt(v / df)
        return (norm.sf(c - lam) + norm.cdf(-c - lam)) * chi2.pdf(v, df)

    val, _ = integrate.quad(f, 0, np.inf, epsabs=1e-12, epsrel=1e-12, limit=500)
    return val


def test_paired_sd_is_the_unbiased_std():
    assert paired_sd([0.1, 0.3, 0.2]) == pytest.approx(0.1)
    assert paired_sd([1.0, 1.0]) == 0.0
    assert math.isnan(paired_sd([0.5])) and math.isnan(paired_sd([]))


def test_mde_approaches_the_normal_formula_for_many_seeds():
    z = norm.ppf(0.975) + norm.ppf(0.8)
    assert z == pytest.approx(2.8016, abs=1e-4)
    for sd in (1.0, 0.04):
        assert mde_paired(sd, 10000) * math.sqrt(10000) / sd == pytest.approx(z, rel=2e-4)
        assert mde_paired(sd, 400) * math.sqrt(400) / sd == pytest.approx(z, rel=1e-2)
        assert mde_paired(sd, 400) > z * sd / math.sqrt(400)  # the t test needs a little more than the z test


def test_mde_for_three_seeds_matches_an_independent_computation():
    m = mde_paired(1.0, 3)
    assert m == pytest.approx(3.26404, abs=1e-4)  # λ = 5.6535 (vs 5.364 from the t-quantile approximation)
    assert _power_by_integral(m, 1.0, 3) == pytest.approx(0.8, abs=1e-6)
    # a seeded simulation of the t-test on 3 normal differences with true mean = the MDE
    rng = np.random.default_rng(12345)
    d = rng.normal(m, 1.0, size=(400_000, 3))
    tstat = d.mean(1) / (d.std(1, ddof=1) / math.sqrt(3))
    rate = float(np.mean(np.abs(tstat) > t.ppf(0.975, 2)))
    assert rate == pytest.approx(0.8, abs=0.004)  # 4 binomial SDs (0.00063 each) would be 0.0025
    # the MDE scales with the SD
    assert mde_paired(0.04, 3) == pytest.approx(0.04 * m, rel=1e-10)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 20, 100])
def test_power_at_the_mde_is_the_target(n):
    for power in (0.8, 0.9):
        m = mde_paired(0.05, n, power=power)
        assert power_paired(m, 0.05, n) == pytest.approx(power, abs=1e-6)
        assert power_paired(-m, 0.05, n) == pytest.approx(power, abs=1e-6)  # two-sided: the sign does not matter
    assert power_paired(mde_paired(1.0, n, alpha=0.01), 1.0, n, alpha=0.01) == pytest.approx(0.8, abs=1e-6)


def test_power_agrees_with_the_integral():
    for effect, sd, n in ((0.5, 1.0, 5), (0.03, 0.041, 17), (2.0, 1.0, 3), (0.1, 0.2, 2)):
        assert power_paired(effect, sd, n) == pytest.approx(_power_by_integral(effect, sd, n), abs=1e-7)
    assert power_paired(0.0, 1.0, 5) == pytest.approx(0.05, abs=1e-12)  # no effect: the level


def test_monotonicity():
    mdes = [mde_paired(1.0, n) for n in range(2, 40)]
    assert all(a > b for a, b in zip(mdes, mdes[1:]))  # more seeds, smaller detectable difference
    assert mde_paired(2.0, 5) > mde_paired(1.0, 5)  # noisier differences, larger
    assert mde_paired(1.0, 5, power=0.9) > mde_paired(1.0, 5, power=0.8)
    assert mde_paired(1.0, 5, alpha=0.01) > mde_paired(1.0, 5, alpha=0.05)
    pw = [power_paired(e, 1.0, 5) for e in np.linspace(0, 3, 31)]
    assert all(a < b for a, b in zip(pw, pw[1:]))
    pn = [power_paired(0.5, 1.0, n) for n in range(2, 60)]
    assert all(a < b for a, b in zip(pn, pn[1:]))
    needs = [seeds_needed(e, 1.0) for e in (2.0, 1.0, 0.5, 0.25)]
    assert needs == sorted(needs) and len(set(needs)) == 4


def test_seeds_needed_is_consistent_with_the_mde():
    for sd in (1.0, 0.041):
        for n in (2, 3, 5, 12, 40):
            m = mde_paired(sd, n)
            assert seeds_needed(m * (1 + 1e-6), sd) == n  # just above the MDE at n: n seeds suffice
            assert seeds_needed(m * (1 - 1e-6), sd) == n + 1  # just below: one more
            assert seeds_needed(-m * (1 + 1e-6), sd) == n
    n = seeds_needed(0.03, 0.041)
    assert mde_paired(0.041, n) <= 0.03 < mde_paired(0.041, n - 1)
    assert power_paired(0.03, 0.041, n) >= 0.8 > power_paired(0.03, 0.041, n - 1)


def test_edge_cases():
    nan = float("nan")
    assert math.isnan(mde_paired(1.0, 1)) and math.isnan(mde_paired(nan, 5)) and math.isnan(mde_paired(1.0, 0))
    assert mde_paired(0.0, 3) == 0.0
    assert math.isnan(power_paired(0.1, 1.0, 1)) and math.isnan(power_paired(0.1, nan, 4))
    assert power_paired(0.1, 0.0, 3) == 1.0
    assert seeds_needed(0.03, nan) is None
    assert seeds_needed(0.03, 0.0) == 2
    assert seeds_needed(0.0, 1.0) is None  # no effect is never detected with 80% power
    assert seeds_needed(1e-3, 1.0) is None  # would need about 7.8 million seeds
    assert seeds_needed(0.05, 1.0, max_n=100) is None and seeds_needed(0.05, 1.0) == 3142
    with pytest.raises(ValueError):
        mde_paired(1.0, 5, power=0.01)
    with pytest.raises(ValueError):
        seeds_needed(0.1, 1.0, alpha=1.5)


def test_degenerate_intervals_are_named_not_reported():
    assert interval_note([0.05]) == "n too small"
    assert interval_note([0.10, 0.12]) == "n too small"  # a 2-seed interval rests on one degree of freedom
    assert interval_note([-0.006, -0.006]) == "no spread, interval undefined"
    # equal changes from different starts differ in the last bits only: still no spread
    assert 0.30 - 0.20 != 0.40 - 0.30
    assert interval_note([0.30 - 0.20, 0.40 - 0.30, 0.50 - 0.40]) == "no spread, interval undefined"
    assert interval_note([0.1, 0.2, 0.4]) is None
    mean, hw, note = reported_interval([0.1, 0.2, 0.4])
    assert (mean, hw, note) == (pytest.approx(0.7 / 3), pytest.approx(t_interval([0.1, 0.2, 0.4])[1]), None)
    assert reported_interval([-0.006, -0.006]) == (pytest.approx(-0.006), None, "no spread, interval undefined")
    assert reported_interval([0.1, 0.3]) == (pytest.approx(0.2), None, "n too small")
