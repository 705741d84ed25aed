"""analysis.stats against scipy and against Monte-Carlo simulation (fixed seeds, vectorized)."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from analysis import stats as st

MC = 20_000  # simulated experiments per power check: Monte-Carlo sd of a rate <= 0.0035


def test_t_interval_and_p_value_match_scipy():
    d = np.array([0.3, 1.1, -0.2, 0.9, 0.4])
    mean, lo, hi, sd = st.t_interval(d, 0.95)
    ref = stats.t.interval(0.95, 4, loc=d.mean(), scale=stats.sem(d))
    assert (mean, lo, hi, sd) == pytest.approx((d.mean(), *ref, d.std(ddof=1)), rel=1e-12)
    assert st.p_value(d) == pytest.approx(stats.ttest_1samp(d, 0).pvalue, rel=1e-12)
    batch = np.stack([d, d + 1])  # leading axes: one interval per row
    np.testing.assert_allclose(st.t_interval(batch, 0.95)[1], [lo, lo + 1])
    assert np.isnan(st.t_interval(np.array([1.0]), 0.95)[1]) and np.isnan(st.p_value(np.array([1.0])))


def test_bootstrap_is_reproducible_and_agrees_with_t_for_many_seeds():
    d = np.random.default_rng(3).normal(2.0, 1.0, 200)
    a, b = st.bootstrap_interval(d, 0.95, 2000, 7), st.bootstrap_interval(d, 0.95, 2000, 7)
    assert a == b  # fixed random state: the same report twice
    assert st.bootstrap_interval(d, 0.95, 2000, 8) != a
    _, lo, hi, _ = st.t_interval(d, 0.95)
    assert a == pytest.approx((lo, hi), abs=0.05)
    assert st.bootstrap_interval(np.array([1.0, 1.0]), 0.95, 100, 0) == (1.0, 1.0)
    assert np.isnan(st.bootstrap_interval(np.array([1.0]), 0.95, 100, 0)[0])


@pytest.mark.parametrize("n,effect", [(2, 20.0), (3, 2.5), (5, 1.2), (12, 0.7)])
def test_t_power_matches_simulated_rejection_rate(n, effect):
    rng = np.random.default_rng(n)
    d = rng.normal(effect, 1.0, (MC, n))
    _, lo, hi, _ = st.t_interval(d, 0.95)
    rate = np.mean((lo > 0) | (hi < 0))
    assert rate == pytest.approx(st.t_power(effect, 1.0, n, 0.05), abs=0.012)


def test_min_detectable_and_seeds_needed_invert_the_power():
    for n in (2, 3, 6, 20):
        mde = st.min_detectable(2.0, n, 0.05, 0.8)
        assert st.t_power(mde, 2.0, n, 0.05) == pytest.approx(0.8, abs=1e-6)
    assert st.min_detectable(2.0, 3, 0.05, 0.8) > st.min_detectable(2.0, 6, 0.05, 0.8)
    needed = st.seeds_needed(lambda k: st.t_power(1.0, 2.0, k, 0.05), 0.8)
    assert st.t_power(1.0, 2.0, needed, 0.05) >= 0.8 > st.t_power(1.0, 2.0, needed - 1, 0.05)
    assert needed == 34  # the textbook paired-t sample size for d = 0.5 at 80% power
    assert st.seeds_needed(lambda k: st.t_power(1e-9, 1.0, k, 0.05), 0.8) is None
    assert np.isnan(st.min_detectable(1.0, 1, 0.05, 0.8)) and np.isnan(st.t_power(1.0, 0.0, 3, 0.05))


@pytest.mark.parametrize("n,delta", [(8, 0.0), (12, 0.3), (20, 0.5)])
def test_tost_power_matches_simulation(n, delta):
    margin, sd = 1.0, 1.0
    d = np.random.default_rng(n).normal(delta, sd, (MC, n))
    rate = np.mean(st.decide_equivalence(d, margin, 0.05) == st.PASS_CODE)
    assert rate == pytest.approx(st.tost_power(delta, sd, n, margin, 0.05), abs=0.02)


def test_iqm_and_probability_of_improvement():
    x = np.array([0.0, 1, 2, 3, 4, 5, 6, 100])
    assert st.iqm(x) == pytest.approx(np.mean([2, 3, 4, 5]))  # the middle 50%: the outlier is out
    hi, lo = np.array([5.0, 6, 7]), np.array([1.0, 2, 3])
    assert st.probability_of_improvement(hi, lo) == 1.0 and st.probability_of_improvement(lo, hi) == 0.0
    assert st.probability_of_improvement(hi, hi) == 0.5  # ties count ½
    assert st.probability_of_improvement(np.array([2.0, 4]), np.array([3.0]), hi, lo) == pytest.approx((0.5 + 1) / 2)


def test_stratified_bootstrap_resamples_within_strata():
    rng = np.random.default_rng(0)
    a, b = rng.normal(10, 1, 6), rng.normal(20, 1, 6)
    lo, hi = st.stratified_bootstrap([a, b], st.pooled_iqm, 0.95, 2000, 1)
    assert lo < st.pooled_iqm(a, b) < hi and (lo, hi) == st.stratified_bootstrap([a, b], st.pooled_iqm, 0.95, 2000, 1)
    # each resample keeps 6 runs of each stratum, so the IQM stays between the strata's means
    assert 10 < lo and hi < 20
    p_lo, p_hi = st.stratified_bootstrap([b, a], st.probability_of_improvement, 0.95, 2000, 1)
    assert p_lo == p_hi == 1.0  # every run of b beats every run of a in every resample
