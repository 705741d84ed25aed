"""Claim checks on constructed sweeps: every claim can PASS, FAIL and be INCONCLUSIVE, by paired tests."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from analysis.claims import (
    FAIL,
    INCONCLUSIVE,
    PASS,
    check_claims,
    claim_e2e_below_gen,
    claim_e2e_is_matches_bf16,
    claim_is_narrows_gap,
    claim_lowest_mismatch,
    other_accuracy_claims,
)
from analysis.config import AnalysisConfig
from analysis.summaries import summarize
from analysis.synthetic import constant_runs as runs_from
from analysis.synthetic import synthetic_runs

SEED = [0.0, 0.03, -0.02, 0.01]  # per-seed offsets shared by every cell of a seed (its prompts)


def per_seed(center: float, noise: tuple[float, ...] = (0.0, 0.0004, -0.0003, 0.0001)) -> list[float]:
    return [center + s + e for s, e in zip(SEED, noise)]


MM_OK = {"bf16": per_seed(1.004), "fp8_gen": per_seed(1.06, (0.001, -0.0005, 0.0, 0.0008)),
         "fp8_e2e": per_seed(1.02, (-0.0002, 0.0003, 0.0001, 0.0))}


def test_claim1_paired_pass_fail_inconclusive():
    r = claim_lowest_mismatch(runs_from(MM_OK))
    assert r.status == PASS and [c.name for c in r.comparisons] == ["fp8_gen − bf16", "fp8_e2e − bf16"]
    c = r.comparisons[0]
    d = np.array(MM_OK["fp8_gen"]) - np.array(MM_OK["bf16"])
    assert c.n == 4 and c.effect == pytest.approx(d.mean())
    assert c.ci == pytest.approx(stats.t.interval(0.95, 3, loc=d.mean(), scale=stats.sem(d)))
    assert "bf16 below fp8_gen at 100%" in r.evidence and "per-run median mismatch" in r.evidence
    worse = {**MM_OK, "bf16": per_seed(1.08)}
    assert claim_lowest_mismatch(runs_from(worse)).status == FAIL
    # fp8_e2e ~ bf16 within noise: one comparison undecided -> not PASS
    close = {**MM_OK, "fp8_e2e": per_seed(1.004, (0.0, -0.001, 0.0012, 0.0002))}
    assert claim_lowest_mismatch(runs_from(close)).status == INCONCLUSIVE
    one_seed = {k: v[:1] for k, v in MM_OK.items()}
    r1 = claim_lowest_mismatch(runs_from(one_seed))
    assert r1.status == INCONCLUSIVE and "at least 2 are needed" in r1.comparisons[0].power_line
    assert claim_lowest_mismatch(runs_from({"fp8_gen": per_seed(1.06)})).status == INCONCLUSIVE  # no bf16


def test_pairing_finds_what_disjoint_intervals_miss():
    """The seed offsets (sd 0.02) swamp the 0.004 gap between fp8_e2e and fp8_gen, but every seed shows it."""
    mm = {"fp8_e2e": per_seed(1.020), "fp8_gen": per_seed(1.024)}
    r = claim_e2e_below_gen(runs_from(mm))
    assert r.status == PASS and r.comparisons[0].effect == pytest.approx(0.004)
    e2e, gen = np.array(mm["fp8_e2e"]), np.array(mm["fp8_gen"])
    hi_e2e = stats.t.interval(0.95, 3, loc=e2e.mean(), scale=stats.sem(e2e))[1]
    lo_gen = stats.t.interval(0.95, 3, loc=gen.mean(), scale=stats.sem(gen))[0]
    assert hi_e2e > lo_gen  # the old rule (disjoint CIs) said INCONCLUSIVE
    assert stats.ttest_ind(gen, e2e).pvalue > 0.5  # and so does an unpaired test
    assert claim_e2e_below_gen(runs_from({"fp8_e2e": mm["fp8_gen"], "fp8_gen": mm["fp8_e2e"]})).status == FAIL


def test_one_runs_spikes_do_not_flip_claims_1_and_2():
    base = runs_from(MM_OK)
    spiked = runs_from(MM_OK, spikes={("bf16", 1): 607.0, ("fp8_e2e", 2): 350.0})
    for claim in (claim_lowest_mismatch, claim_e2e_below_gen):
        assert claim(base).status == claim(spiked).status == PASS
    s = summarize(next(r for r in spiked if r.run_id == "bf16-none-1"))
    assert s.mismatch_max == 607.0 and s.mismatch_median == pytest.approx(MM_OK["bf16"][1])
    assert s.mismatch_mean > 100  # what a mean over steps would have compared (the old claims)


def test_spikes_in_synthetic_store_runs_and_tails():
    runs = synthetic_runs(seeds=3, steps=21, spikes={("fp8_e2e", "none", 0): 600.0}, tails=True)
    cfg = AnalysisConfig(bootstrap_resamples=200)
    before = [r.status for r in check_claims(synthetic_runs(seeds=3, steps=21), cfg)]
    after = [r.status for r in check_claims(runs, cfg)]
    assert before[:2] == after[:2] == [PASS, PASS]
    s = summarize(next(r for r in runs if r.tags["cell_id"] == "fp8_e2e-none-0"))
    assert s.mismatch_max == 600.0 and s.mismatch_p99 > 100 and all(np.isfinite(s.frac_gt))
    assert np.isnan(summarize(synthetic_runs(seeds=1, steps=3)[0]).frac_gt).all()  # not logged: n/a


def acc_of(center: float, noise=(0.0, 0.004, -0.003, 0.001)) -> list[float]:
    return [center + s + e for s, e in zip(SEED, noise)]


ACC_OK = {("bf16", "none"): acc_of(0.70), ("bf16", "token"): acc_of(0.70, (0.001, 0.002, -0.002, 0.0)),
          ("fp8_gen", "none"): acc_of(0.50), ("fp8_gen", "token"): acc_of(0.66), ("fp8_e2e", "token"): acc_of(0.698)}


def test_claim3_is_narrows_gap():
    r = claim_is_narrows_gap(runs_from(acc=ACC_OK))
    assert r.status == PASS and "gap without IS +20.0 pts, with IS +4.0 pts" in r.evidence
    assert r.comparisons[0].effect == pytest.approx(16.0) and r.comparisons[0].unit == "pts"
    assert claim_is_narrows_gap(runs_from(acc={**ACC_OK, ("fp8_gen", "token"): acc_of(0.40)})).status == FAIL
    overshoot = {**ACC_OK, ("fp8_gen", "token"): acc_of(0.95)}  # past bf16 by more than the gap was
    assert claim_is_narrows_gap(runs_from(acc=overshoot)).status == FAIL
    same = {**ACC_OK, ("fp8_gen", "token"): acc_of(0.50, (0.003, -0.002, 0.001, -0.004))}
    assert claim_is_narrows_gap(runs_from(acc=same)).status == INCONCLUSIVE
    no_is = {k: v for k, v in ACC_OK.items() if k[1] == "none"}
    assert claim_is_narrows_gap(runs_from(acc=no_is)).status == INCONCLUSIVE


def test_claim4_tost_with_the_margin():
    r = claim_e2e_is_matches_bf16(runs_from(acc=ACC_OK))
    assert r.status == PASS and r.margin == 2.0 and "±2 pts" in r.claim
    c = r.comparisons[0]
    assert c.name == "fp8_e2e+token − bf16+token" and c.ci_level == pytest.approx(0.90)
    assert -2 < c.ci[0] < c.ci[1] < 2
    assert claim_e2e_is_matches_bf16(runs_from(acc=ACC_OK), AnalysisConfig(equivalence_margin=0.1)).status != PASS
    far = {**ACC_OK, ("fp8_e2e", "token"): acc_of(0.60)}
    assert claim_e2e_is_matches_bf16(runs_from(acc=far)).status == FAIL
    # 1.5 points off, inside the margin, but noisy: TOST cannot show equivalence with 4 seeds
    noisy = {**ACC_OK, ("fp8_e2e", "token"): acc_of(0.715, (0.02, -0.03, 0.025, -0.01))}
    r = claim_e2e_is_matches_bf16(runs_from(acc=noisy))
    assert r.status == INCONCLUSIVE and "seeds would show equivalence" in r.comparisons[0].power_line
    two = {k: v[:2] for k, v in noisy.items()}
    assert claim_e2e_is_matches_bf16(runs_from(acc=two)).status == INCONCLUSIVE
    no_bf16_token = {k: v for k, v in ACC_OK.items() if k != ("bf16", "token")}
    assert claim_e2e_is_matches_bf16(runs_from(acc=no_bf16_token)).comparisons[0].name == "fp8_e2e+token − bf16+none"


def test_check_claims_all_pass_and_empty_data():
    results = check_claims(runs_from(MM_OK, ACC_OK))
    assert [r.number for r in results] == [1, 2, 3, 4] and all(r.status == PASS for r in results)
    assert all(r.status == INCONCLUSIVE for r in check_claims(runs_from()))
    js = results[3].to_dict()
    assert js["status"] == PASS and js["margin"] == 2.0 and isinstance(js["comparisons"][0]["ci"], list)


def test_step_order_fraction_is_paired_by_seed_and_step():
    runs = runs_from({"bf16": [1.0, 1.0, 1.0], "fp8_gen": [1.1, 1.1, 1.1]})
    for r in runs:  # seed 0: fp8_gen below bf16 on the first 4 of 8 steps (IS none and token alike)
        if r.tags["recipe"] == "fp8_gen" and r.tags["seed"] == "0":
            steps, v = r.metrics["token_mult_prob_error"]
            r.metrics["token_mult_prob_error"] = (steps, np.r_[np.full(4, 0.9), v[4:]])
    (order,) = claim_lowest_mismatch(runs).step_order
    fractions = np.array([0.5, 1.0, 1.0])
    lo, hi = stats.t.interval(0.95, 2, loc=fractions.mean(), scale=stats.sem(fractions))
    assert order["fraction"] == pytest.approx(fractions.mean()) and order["n"] == 3
    assert order["ci"] == pytest.approx((max(lo, 0), min(hi, 1)))
    assert "bf16 below fp8_gen at 83%" in claim_lowest_mismatch(runs).evidence


def test_claim3_second_half_does_not_close_it_is_shown_not_decided():
    acc = {**ACC_OK, ("fp8_gen", "token"): acc_of(0.66, (0.002, -0.001, 0.0, 0.003))}
    r = claim_is_narrows_gap(runs_from(acc=acc))
    narrows, left = r.comparisons
    assert r.status == PASS and narrows.decides and not left.decides and "does not close it" in left.name
    d = (np.array(acc[("bf16", "none")]) - np.array(acc[("fp8_gen", "token")])) * 100
    assert left.effect == pytest.approx(d.mean()) and left.n == 4
    assert left.ci == pytest.approx(stats.t.interval(0.95, 3, loc=d.mean(), scale=stats.sem(d)))
    assert left.finding == "not closed"
    assert f"Does not close it (not deciding): gap left {d.mean():+.1f} pts, 95% interval [{left.ci[0]:+.1f} pts, " \
           f"{left.ci[1]:+.1f} pts]: not closed" in r.evidence
    # IS closes the gap (within noise): "narrows" still PASSes, the second half says closing is not excluded
    closed = {**ACC_OK, ("fp8_gen", "token"): acc_of(0.70, (0.003, -0.002, 0.001, -0.004))}
    r = claim_is_narrows_gap(runs_from(acc=closed))
    assert r.status == PASS and r.comparisons[1].finding == "closing not excluded"
    past = {**ACC_OK, ("fp8_gen", "token"): acc_of(0.75)}  # beyond bf16 by less than the gap was
    r = claim_is_narrows_gap(runs_from(acc=past))
    assert r.status == PASS and r.comparisons[1].finding == "overshot"


ACC_EVAL = {**ACC_OK, ("fp8_e2e", "token"): acc_of(0.698), ("fp8_gen", "none"): acc_of(0.60),
            ("fp8_gen", "token"): acc_of(0.68)}  # through one BF16 engine: FP8 inference's cost removed


def test_claims_3_4_decide_on_the_configured_accuracy_metric():
    # val_accuracy: fp8_e2e + IS is 10 points below bf16 (FP8 inference costs accuracy); through the
    # BF16 evaluation engine its weights are as good as bf16's
    own = {**ACC_OK, ("fp8_e2e", "token"): acc_of(0.60)}
    runs = runs_from(MM_OK, own, acc_bf16_eval=ACC_EVAL)
    by_own = check_claims(runs)
    assert by_own[3].status == FAIL and by_own[3].metric == "val_accuracy" and by_own[3].deciding
    cfg = AnalysisConfig(accuracy_metric="val_accuracy_bf16_eval")
    by_eval = check_claims(runs, cfg)
    assert by_eval[3].status == PASS and by_eval[3].metric == "val_accuracy_bf16_eval"
    assert all("final val_accuracy_bf16_eval" in r.statistic for r in by_eval[2:])
    assert by_eval[2].comparisons[0].effect == pytest.approx(8.0)  # 60 -> 68 towards 70
    aside = other_accuracy_claims(runs, cfg)
    assert [(r.number, r.metric, r.deciding) for r in aside] == [(3, "val_accuracy", False), (4, "val_accuracy", False)]
    assert [r.status for r in aside] == [by_own[2].status, by_own[3].status]
    assert [c.ci for c in aside[1].comparisons] == [c.ci for c in by_own[3].comparisons]
    assert by_eval[:2] == check_claims(runs)[:2]  # claims 1-2 read no accuracy


def test_older_runs_without_bf16_eval_do_not_crash():
    runs = runs_from(MM_OK, ACC_OK)  # logged before val_accuracy_bf16_eval existed
    assert other_accuracy_claims(runs) == []
    results = check_claims(runs, AnalysisConfig(accuracy_metric="val_accuracy_bf16_eval"))
    assert [r.status for r in results] == [PASS, PASS, INCONCLUSIVE, INCONCLUSIVE]
    assert all(r.evidence.startswith("val_accuracy_bf16_eval: missing (not logged by these runs)") for r in results[2:])
    flipped = other_accuracy_claims(runs, AnalysisConfig(accuracy_metric="val_accuracy_bf16_eval"))
    assert flipped[0].metric == "val_accuracy" and not flipped[0].deciding
