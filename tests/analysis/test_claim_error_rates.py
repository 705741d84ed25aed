"""The claims' decision rules over thousands of simulated sweeps (vectorized: `simulate_cells`).

Each claim is a pure function of per-run summaries, so the rules the claims call (`decide_positive`,
`gap_statistic`, `decide_equivalence`) are simulated on [sims, seeds] arrays; `test_rules_are_what_
check_claims_uses` ties them to `check_claims` on real RunHistory sweeps. Rates are compared with
their bound plus 3 Monte-Carlo standard errors, sqrt(p (1 − p) / SIMS).
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from analysis import stats as st
from analysis.claims import VERDICT, check_claims, gap_statistic
from analysis.config import AnalysisConfig
from analysis.summaries import paired, summarize_all
from analysis.synthetic import simulate_cells, synthetic_runs

SIMS = 4000
ALPHA = 0.05


def mc_bound(p: float, sims: int = SIMS) -> float:
    return p + 3 * np.sqrt(p * (1 - p) / sims)


def rate(codes: np.ndarray, code: int) -> float:
    return float(np.mean(codes == code))


@pytest.mark.parametrize("seeds", [2, 3, 8])
def test_null_false_positive_rates(seeds):
    rng = np.random.default_rng(seeds)
    # claims 1-2: three recipes with equal mismatch; a shared seed effect that pairing removes
    x = simulate_cells(rng, SIMS, seeds, {"bf16": 1.0, "fp8_gen": 1.0, "fp8_e2e": 1.0}, seed_sd=0.5, run_sd=0.01)
    claim1 = st.decide_positive([x["fp8_gen"] - x["bf16"], x["fp8_e2e"] - x["bf16"]], ALPHA)
    claim2 = st.decide_positive([x["fp8_gen"] - x["fp8_e2e"]], ALPHA)
    # claim 3: IS changes nothing (B = A in law), whatever the gap to bf16 is
    acc = simulate_cells(rng, SIMS, seeds, {"bf16": 70.0, "a": 60.0, "b": 60.0}, seed_sd=3.0, run_sd=2.0)
    claim3 = st.decide_positive([gap_statistic(acc["bf16"], acc["a"], acc["b"])], ALPHA)
    for codes in (claim1, claim2, claim3):
        assert rate(codes, st.PASS_CODE) <= mc_bound(ALPHA / 2)
        assert np.mean(codes != st.NONE_CODE) <= mc_bound(ALPHA)  # any decisive verdict at the null
    # claim 4 (equivalence): its null is a true difference at the margin
    d = rng.normal(2.0, 1.5, (SIMS, seeds))
    assert rate(st.decide_equivalence(d, 2.0, ALPHA), st.PASS_CODE) <= mc_bound(ALPHA)


def test_claim3_null_with_no_gap_at_all():
    rng = np.random.default_rng(11)
    acc = simulate_cells(rng, SIMS, 4, {"bf16": 60.0, "a": 60.0, "b": 60.0}, run_sd=2.0)
    codes = st.decide_positive([gap_statistic(acc["bf16"], acc["a"], acc["b"])], ALPHA)
    assert rate(codes, st.PASS_CODE) <= mc_bound(ALPHA / 2)


@pytest.mark.parametrize("seeds,sd", [(3, 1.0), (5, 2.0), (10, 0.5)])
def test_the_promised_effect_is_detected_80_percent_of_the_time(seeds, sd):
    effect = st.min_detectable(sd, seeds, ALPHA, 0.8)  # what the power line promises
    d = np.random.default_rng(seeds).normal(effect, sd, (SIMS, seeds))
    found = rate(st.decide_positive([d], ALPHA), st.PASS_CODE)
    assert found == pytest.approx(0.8, abs=0.03)


def test_seeds_the_power_line_asks_for_are_enough():
    sd, effect = 3.0, 3.0  # "about N seeds would detect 3 points"
    n = st.seeds_needed(lambda k: st.t_power(effect, sd, k, ALPHA), 0.8)
    d = np.random.default_rng(5).normal(effect, sd, (SIMS, n))
    assert rate(st.decide_positive([d], ALPHA), st.PASS_CODE) == pytest.approx(0.8, abs=0.03)
    d_fewer = np.random.default_rng(6).normal(effect, sd, (SIMS, n - 2))
    assert rate(st.decide_positive([d_fewer], ALPHA), st.PASS_CODE) < 0.8


def test_tost_refuses_equivalence_beyond_the_margin():
    rng = np.random.default_rng(4)
    for true in (2.5, 3.0, -3.0):  # beyond ±2 points
        codes = st.decide_equivalence(rng.normal(true, 1.0, (SIMS, 8)), 2.0, ALPHA)
        assert rate(codes, st.PASS_CODE) <= mc_bound(ALPHA)
    far = st.decide_equivalence(rng.normal(5.0, 1.0, (SIMS, 8)), 2.0, ALPHA)
    assert rate(far, st.FAIL_CODE) > 0.95 and rate(far, st.PASS_CODE) == 0
    # the old rule ("E's mean inside bf16's 95% CI") passed more easily the noisier the data; TOST does not
    bf16, e2e = rng.normal(70.0, 8.0, (SIMS, 2)), rng.normal(65.0, 8.0, (SIMS, 2))  # 5 points apart, 2 seeds
    _, lo, hi, _ = st.t_interval(bf16, 0.95)
    old_pass = np.mean((lo <= e2e.mean(-1)) & (e2e.mean(-1) <= hi))
    assert old_pass > 0.8
    assert rate(st.decide_equivalence(e2e - bf16, 2.0, ALPHA), st.PASS_CODE) <= mc_bound(ALPHA)
    n_needed = st.seeds_needed(lambda k: st.tost_power(0.0, 1.0, k, 2.0, ALPHA), 0.8)
    at_zero = st.decide_equivalence(rng.normal(0.0, 1.0, (SIMS, n_needed)), 2.0, ALPHA)
    assert rate(at_zero, st.PASS_CODE) == pytest.approx(0.8, abs=0.05)


def test_small_consistent_paired_effect_found_where_unpaired_misses_it():
    """A 1-point IS gain on every seed, under 5 points of seed-to-seed spread (the seed's prompts)."""
    rng = np.random.default_rng(9)
    acc = simulate_cells(rng, SIMS, 5, {"none": 60.0, "token": 61.0}, seed_sd=5.0, run_sd=0.3)
    paired_found = rate(st.decide_positive([acc["token"] - acc["none"]], ALPHA), st.PASS_CODE)
    unpaired_p = stats.ttest_ind(acc["token"], acc["none"], axis=-1).pvalue
    unpaired_found = float(np.mean((unpaired_p < ALPHA) & (acc["token"].mean(-1) > acc["none"].mean(-1))))
    assert paired_found > 0.9 and unpaired_found < 0.1


def test_rules_are_what_check_claims_uses():
    """`check_claims` on synthetic RunHistory sweeps decides exactly as the simulated rules do."""
    cfg = AnalysisConfig(bootstrap_resamples=200)
    for i in range(6):
        runs = synthetic_runs(seeds=3, steps=6, rng_seed=i, mismatch={"bf16": 1.02, "fp8_gen": 1.021, "fp8_e2e": 1.02},
                              final_acc={}, seed_sd=0.02, shared_sd=0.02)
        results = check_claims(runs, cfg)
        sums = summarize_all(runs)
        d1 = [paired(sums, "bf16", rc, "mismatch_median")[0] for rc in ("fp8_gen", "fp8_e2e")]
        assert results[0].status == VERDICT[int(st.decide_positive(d1, cfg.alpha))]
        d2 = paired(sums, "fp8_e2e", "fp8_gen", "mismatch_median")[0]
        assert results[1].status == VERDICT[int(st.decide_positive([d2], cfg.alpha))]
        acc = {(s.recipe, s.importance_sampling): {} for s in sums}
        for s in sums:
            acc[(s.recipe, s.importance_sampling)][s.seed] = s.final_accuracy * 100
        ref, a, b = (np.array([acc[c][k] for k in sorted(acc[c])]) for c in
                     (("bf16", "none"), ("fp8_gen", "none"), ("fp8_gen", "token")))
        assert results[2].status == VERDICT[int(st.decide_positive([gap_statistic(ref, a, b)], cfg.alpha))]
        d4 = paired(sums, "bf16", "fp8_e2e", "final_accuracy", isv="token")[0] * 100
        assert results[3].status == VERDICT[int(st.decide_equivalence(d4, cfg.equivalence_margin, cfg.alpha))]
        assert results[3].comparisons[0].effect == pytest.approx(d4.mean())
