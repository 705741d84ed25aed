"""Claim checks on constructed cases: every claim can PASS, FAIL and be INCONCLUSIVE."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from analysis.claims import (FAIL, INCONCLUSIVE, PASS, check_claims, claim_e2e_below_gen, claim_e2e_is_matches_bf16,
                             claim_is_narrows_gap, claim_lowest_mismatch, claims_markdown)
from analysis.fetch import RunHistory


def runs_from(mismatch: dict[str, list[float]] | None = None, acc: dict[tuple[str, str], list[float]] | None = None):
    """Runs with constant histories: one per listed seed value (mismatch per recipe, split over IS none/token)."""
    out = []
    steps = np.arange(4)
    for recipe, values in (mismatch or {}).items():
        for i, v in enumerate(values):
            tags = {"recipe": recipe, "importance_sampling": ("none", "token")[i % 2], "seed": str(i // 2)}
            out.append(RunHistory(f"m{recipe}{i}", "", "FINISHED", tags, {}, {"token_mult_prob_error": (steps, np.full(4, v))}))
    for (recipe, isv), values in (acc or {}).items():
        for i, v in enumerate(values):
            tags = {"recipe": recipe, "importance_sampling": isv, "seed": str(i)}
            out.append(RunHistory(f"a{recipe}{isv}{i}", "", "FINISHED", tags, {}, {"val_accuracy": (steps, np.r_[0.1, 0.2, 0.3, v])}))
    return out


def half(x):
    return stats.t.ppf(0.975, len(x) - 1) * stats.sem(x)


TIGHT = [0.0, 0.002, -0.002]  # per-seed offsets: sd 0.002, 95% CI half-width t(0.975, 2) * 0.002 / sqrt(3) = 0.005


def spread(center, offsets=TIGHT):
    return [center + o for o in offsets]


def test_claim1_lowest_mismatch():
    ok = runs_from({"bf16": spread(1.004), "fp8_gen": spread(1.06), "fp8_e2e": spread(1.03)})
    assert claim_lowest_mismatch(ok).status == PASS
    worse = runs_from({"bf16": spread(1.08), "fp8_gen": spread(1.06), "fp8_e2e": spread(1.03)})
    assert claim_lowest_mismatch(worse).status == FAIL
    overlap = runs_from({"bf16": spread(1.004, [0, 0.02, -0.02]), "fp8_gen": spread(1.06), "fp8_e2e": spread(1.01)})
    r = claim_lowest_mismatch(overlap)
    assert r.status == INCONCLUSIVE and "bf16 1.0040" in r.evidence
    assert claim_lowest_mismatch(runs_from({"bf16": [1.0], "fp8_gen": [1.06]})).status == INCONCLUSIVE  # one seed
    assert claim_lowest_mismatch(runs_from({"fp8_gen": spread(1.06)})).status == INCONCLUSIVE  # no bf16


def test_claim2_e2e_below_gen():
    assert claim_e2e_below_gen(runs_from({"fp8_gen": spread(1.06), "fp8_e2e": spread(1.02)})).status == PASS
    assert claim_e2e_below_gen(runs_from({"fp8_gen": spread(1.02), "fp8_e2e": spread(1.06)})).status == FAIL
    assert claim_e2e_below_gen(runs_from({"fp8_gen": spread(1.03), "fp8_e2e": spread(1.029)})).status == INCONCLUSIVE


def test_claim2_boundary_follows_the_t_interval():
    # e2e hi and gen lo computed independently; shift gen so that they just overlap / just separate
    e2e = [1.02, 1.03, 1.01]
    gen_offsets = [0.0, 0.01, -0.01]
    gap = (np.mean(e2e) + half(np.array(e2e))) + half(np.array(gen_offsets))  # gen center where lo(gen) == hi(e2e)
    just_apart = runs_from({"fp8_e2e": e2e, "fp8_gen": spread(gap + 1e-6, gen_offsets)})
    just_touch = runs_from({"fp8_e2e": e2e, "fp8_gen": spread(gap - 1e-6, gen_offsets)})
    assert claim_e2e_below_gen(just_apart).status == PASS
    assert claim_e2e_below_gen(just_touch).status == INCONCLUSIVE


ACC_OK = {("bf16", "none"): spread(0.70), ("fp8_gen", "none"): spread(0.50), ("fp8_gen", "token"): spread(0.66),
          ("fp8_e2e", "token"): spread(0.698)}


def test_claim3_is_narrows_gap():
    r = claim_is_narrows_gap(runs_from(acc=ACC_OK))
    assert r.status == PASS and "gap without IS +20.0 pts, with IS +4.0 pts" in r.evidence
    worse = {**ACC_OK, ("fp8_gen", "token"): spread(0.40)}
    assert claim_is_narrows_gap(runs_from(acc=worse)).status == FAIL
    overshoot = {**ACC_OK, ("fp8_gen", "token"): spread(0.95)}  # moved past bf16 by more than the gap
    assert claim_is_narrows_gap(runs_from(acc=overshoot)).status == FAIL
    same = {**ACC_OK, ("fp8_gen", "token"): spread(0.505)}
    assert claim_is_narrows_gap(runs_from(acc=same)).status == INCONCLUSIVE
    no_is = {k: v for k, v in ACC_OK.items() if k[1] == "none"}
    assert claim_is_narrows_gap(runs_from(acc=no_is)).status == INCONCLUSIVE


def test_claim4_e2e_with_is_within_bf16_ci():
    assert claim_e2e_is_matches_bf16(runs_from(acc=ACC_OK)).status == PASS
    far = {**ACC_OK, ("fp8_e2e", "token"): spread(0.55)}
    assert claim_e2e_is_matches_bf16(runs_from(acc=far)).status == FAIL
    # outside bf16's CI but the CIs overlap: e2e's CI is wide
    bf16 = spread(0.70)
    near = bf16[0] + half(np.array(bf16)) + 0.005
    wide = {**ACC_OK, ("fp8_e2e", "token"): spread(near, [0.0, 0.05, -0.05])}
    r = claim_e2e_is_matches_bf16(runs_from(acc=wide))
    assert r.status == INCONCLUSIVE, r.evidence
    one_seed = {**ACC_OK, ("fp8_e2e", "token"): [0.70]}
    assert claim_e2e_is_matches_bf16(runs_from(acc=one_seed)).status == INCONCLUSIVE


def test_check_claims_and_markdown():
    runs = runs_from({"bf16": spread(1.004), "fp8_gen": spread(1.06), "fp8_e2e": spread(1.03)}, ACC_OK)
    results = check_claims(runs)
    assert [r.number for r in results] == [1, 2, 3, 4] and all(r.status == PASS for r in results)
    md = claims_markdown(results)
    assert md.count("**PASS**") == 4 and "INCONCLUSIVE" in md  # the rule is stated
    with pytest.raises(AssertionError):
        assert all(r.status == PASS for r in check_claims(runs_from()))  # no data: not PASS
